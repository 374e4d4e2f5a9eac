"""``graph_break``: mark a function as an eager break point of a breakable graph
(docs/breakable.md)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any, TypeVar, overload

import torch

from .engines.recorder import active_recorder

F = TypeVar("F", bound=Callable[..., Any])


@overload
def graph_break(fn: F) -> F: ...
@overload
def graph_break(fn: None = None, *, reads: str | Iterable[str] = (),
                writes: str | Iterable[str] = ()) -> Callable[[F], F]: ...


def _names(field: str, value: str | Iterable[str]) -> frozenset[str]:
    """``reads``/``writes`` as a set of names: one string is one name (``reads="out"``)."""
    try:
        names = (value,) if isinstance(value, str) else tuple(value)
    except TypeError:
        names = (value,)
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        msg = (f"graph_break({field}=...) takes parameter names (a str or an iterable of str, e.g. "
               f"{field}=('out',)), got {value!r} with {bad[0]!r} of type {type(bad[0]).__name__}")
        raise TypeError(msg)
    return frozenset(names)


def graph_break(fn: F | None = None, *, reads: str | Iterable[str] = (),
                writes: str | Iterable[str] = ()) -> F | Callable[[F], F]:
    """Decorate ``fn`` as an eager break point: inside a breakable capture the open segment ends, the
    function runs eagerly, and at replay it runs again between the two segments; anywhere else
    (under ``torch.compile`` too) it is a plain call.

    :param reads: parameter names of activation tensors the function reads (kept by non-owning
        alias): one name (``reads="out"``) or several (``reads=("q", "k")``).
    :param writes: parameter names of activation tensors it writes in place, spelled like
        ``reads``. Tensor arguments named in neither are held strongly, per key.
    :raises TypeError: ``reads``/``writes`` is not a str or an iterable of str.
    :raises ValueError: a name in ``reads``/``writes`` is not a parameter of ``fn``."""
    read_set, write_set = _names("reads", reads), _names("writes", writes)

    def decorate(func: F) -> F:
        sig = inspect.signature(func)
        unknown = sorted((read_set | write_set) - set(sig.parameters))
        if unknown:
            msg = (f"graph_break({func.__qualname__}): reads/writes name {unknown}, which are not "
                   f"parameters of it; parameters: {list(sig.parameters)}")
            raise ValueError(msg)

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            # under torch.compile: dynamo cannot trace the recorder lookup
            on_break = None if torch.compiler.is_compiling() else getattr(active_recorder(), "on_break", None)
            if on_break is None:
                return func(*args, **kwargs)
            return on_break(func, sig.bind(*args, **kwargs), read_set, write_set)

        wrapper.__sglang_bcg_break__ = True  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    if fn is not None:
        if not callable(fn):
            msg = f"graph_break takes a function, got {fn!r}; pass names as keywords: @graph_break(reads=('out',))"
            raise TypeError(msg)
        return decorate(fn)
    return decorate
