"""``graph_break``: mark a function as an eager break point of a breakable graph (docs/breakable.md)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any, TypeVar, overload

import torch

from .engines.breakable import break_name
from .engines.recorder import active_recorder
from .errors import GraphBreakError

F = TypeVar("F", bound=Callable[..., Any])

#: The signature of a callable ``inspect`` cannot read (a builtin): any call binds, nothing is named.
_ANY_CALL = inspect.Signature([inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL),
                               inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)])

#: How to give a callable parameter names, said by every error about names.
_WRAP = ("wrap it in a plain Python def whose parameters carry the names and that calls it, e.g. "
         "@graph_break(reads=('q', 'k', 'v')) def attention(q, k, v): return "
         "torch.nn.functional.scaled_dot_product_attention(q, k, v)")


def _names(field: str, value: str | Iterable[str]) -> frozenset[str]:
    """``reads``/``writes`` as a set of names: one string is one name (``reads="out"``)."""
    try:
        names: tuple[object, ...] = (value,) if isinstance(value, str) else tuple(value)
    except TypeError:
        names = (value,)
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise GraphBreakError(f"graph_break({field}=...) takes parameter names (a str or an iterable of str, e.g. "
                              f"{field}=('out',)), got {value!r} with {bad[0]!r} of type {type(bad[0]).__name__}")
    return frozenset(n for n in names if isinstance(n, str))


def _signature(func: Callable[..., Any], name: str, names: frozenset[str]) -> inspect.Signature:
    """``func``'s signature, checked against the ``reads``/``writes`` ``names``; a callable without
    one (a builtin such as ``torch.add``) binds any call when no names are given.
    :raises GraphBreakError: a name is not a parameter, or no signature to find it in."""
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError) as exc:
        if names:
            raise GraphBreakError(f"graph_break({name}, reads/writes={sorted(names)}): Python has no signature for it "
                                  f"({exc}), so the names cannot be matched to its arguments; {_WRAP}") from None
        return _ANY_CALL  # no names: every tensor argument is held as it is, which is always sound
    unknown = sorted(names - set(sig.parameters))
    if unknown:
        raise GraphBreakError(f"graph_break({name}): reads/writes name {unknown}, which are not parameters of it; "
                              f"parameters: {list(sig.parameters)}; name those, or {_WRAP}")
    return sig


@overload
def graph_break(fn: F) -> F: ...
@overload
def graph_break(fn: None = None, *, reads: str | Iterable[str] = (),
                writes: str | Iterable[str] = ()) -> Callable[[F], F]: ...


def graph_break(fn: F | None = None, *, reads: str | Iterable[str] = (),
                writes: str | Iterable[str] = ()) -> F | Callable[[F], F]:
    """Decorate ``fn`` as an eager break point: inside a breakable capture the open segment ends, the
    function runs eagerly, and at replay it runs again between the two segments; anywhere else
    (under ``torch.compile`` too) it is a plain call.

    ``fn`` may be any callable: a function, a bound method, a ``functools.partial``, an object with
    ``__call__``, a builtin (``torch.add``, ``torch.nn.functional.scaled_dot_product_attention``).
    Naming ``reads``/``writes`` needs its signature; a builtin has none, so wrap it in a ``def``.
    Numbers and strings it returns are fixed at capture (replay raises where they change).

    :param reads: parameter names of activation tensors the function reads (kept by non-owning
        alias): one name (``reads="out"``) or several (``reads=("q", "k")``).
    :param writes: parameter names of activation tensors it writes in place, spelled like
        ``reads``. Tensor arguments named in neither are held strongly, per key.
    :raises GraphBreakError: (a ``TypeError`` and a ``ValueError``) ``reads``/``writes`` is not a str
        or an iterable of str, a name in them is not a parameter of ``fn`` or ``fn`` has no signature
        to find it in, or ``fn`` is not callable."""
    read_set, write_set = _names("reads", reads), _names("writes", writes)

    def decorate(func: F) -> F:
        if not callable(func):
            msg = f"graph_break takes a function, got {func!r}; pass names as keywords: @graph_break(reads=('out',))"
            raise GraphBreakError(msg)
        sig = _signature(func, break_name(func), read_set | write_set)

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            # under torch.compile: dynamo cannot trace the recorder lookup
            on_break = None if torch.compiler.is_compiling() else getattr(active_recorder(), "on_break", None)
            if on_break is None:
                return func(*args, **kwargs)
            return on_break(func, sig.bind(*args, **kwargs), read_set, write_set)

        wrapper.__sglang_bcg_break__ = True  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return decorate if fn is None else decorate(fn)
