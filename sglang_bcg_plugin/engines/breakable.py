"""The Breakable front of the segment recorder: breaks are ``@graph_break`` functions (what crosses a
break, and why it costs no bridge memory: docs/breakable.md)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from ..output.released import maybe_alias
from ..output.trees import Node, flatten, storage_key, unflatten
from .base import Front
from .recorder import Recorder, Rerun, Segments, refresh


class BreakableRecorder(Recorder):
    """Records one key of a breakable forward; ``graph_break`` wrappers call :meth:`on_break`."""

    def on_break(self, fn: Callable[..., Any], bound: inspect.BoundArguments, reads: frozenset[str],
                 writes: frozenset[str]) -> Any:
        if self.in_break:
            return fn(*bound.args, **bound.kwargs)
        args, kwargs = bound.args, bound.kwargs
        arg_keys = {storage_key(t) for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)}
        with self.eager_break():
            result = fn(*args, **kwargs)
        spec, leaves = _flatten_return(fn, result)
        targets = self.fresh_returns([t for _, t in leaves], arg_keys)
        kept = inspect.BoundArguments(bound.signature, bound.arguments.copy())
        for name in (reads | writes) & kept.arguments.keys():
            kept.arguments[name] = maybe_alias(kept.arguments[name])
        step = _Step(f"break {break_name(fn)}", fn, kept.args, kept.kwargs, [maybe_alias(t) for t in targets],
                     _plain_values(spec, "output"))
        self.add_step(step, (step.args, step.kwargs))  # strong: whatever was not aliased
        return unflatten(spec, targets)


def break_name(fn: Callable[..., Any]) -> str:
    """How errors name a break function: its qualified name, or its repr (a ``functools.partial``, an
    object with ``__call__``)."""
    name = getattr(fn, "__qualname__", None)
    return name if isinstance(name, str) else repr(fn)


#: Plain values a break returns that replay compares with the capture's (others may lack ``==``).
_SCALARS = (bool, int, float, complex, str, bytes)


def _plain_values(node: Node, path: str) -> list[tuple[str, object]]:
    """``(path, value)`` of the numbers and strings in a break's flattened return."""
    if node.kind == "value":
        return [(path, node.value)] if isinstance(node.value, _SCALARS) else []
    return [pair for key, child in zip(node.keys, node.children, strict=True)
            for pair in _plain_values(child, f"{path}[{key!r}]")]


def _flatten_return(fn: Callable[..., Any], result: Any,
                    path: str | None = None) -> tuple[Any, list[tuple[str, torch.Tensor]]]:
    """``flatten`` of what break ``fn`` returned, rooted at ``path`` (default ``name(...)``).
    :raises TypeError: a return value replay cannot track, naming the break."""
    name = break_name(fn)
    try:
        return flatten(result, path=f"{name}(...)" if path is None else path)
    except TypeError as exc:
        raise TypeError(f"@graph_break function {name} returned a value replay cannot track: {exc}") from None


class _Step(Rerun):
    """Replay of one break: run the function again and refresh its returned tensors (``outs``); the
    numbers and strings it returned (``plain``) must come back the same, as the forward used them."""

    __slots__ = ("plain",)

    def __init__(self, what: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                 outs: list[Any], plain: list[tuple[str, object]]) -> None:
        super().__init__(what, fn, args, kwargs, outs)
        self.plain = plain

    def __call__(self) -> None:
        out = self.fn(*self.args, **self.kwargs)
        if not self.outs and not self.plain:
            return
        spec, new = _flatten_return(self.fn, out, "output")
        now = _plain_values(spec, "output")
        for (path, was), (_, value) in zip(self.plain, now, strict=False):
            if not _same(was, value):
                msg = (f"{self.what} returned {value!r} at {path} on replay, {was!r} at capture: the forward's "
                       "Python ran once, at capture, so everything after the break used the capture's value; "
                       "return it as a tensor (torch.tensor(value) inside the break) so replay can refresh it")
                raise RuntimeError(msg)
        if len(now) != len(self.plain):
            msg = f"{self.what} returned {len(now)} numbers or strings on replay, captured {len(self.plain)}"
            raise RuntimeError(msg)
        if len(new) != len(self.outs):
            raise RuntimeError(f"{self.what} returned {len(new)} tensors on replay, captured {len(self.outs)}")
        for view, (path, t) in zip(self.outs, new, strict=True):
            refresh(view, t, f"{self.what} at {path}")


def _same(a: object, b: object) -> bool:
    """Equal plain values, NaN equal to NaN."""
    return a == b or (a != a and b != b)  # noqa: PLR0124 - NaN is the one value not equal to itself


class BreakableFront(Front):
    """The Breakable front of the segmented engine: no bridges (arguments pass as they are)."""

    def recorder(self, key: object, segments: Segments, partition: int | None,
                 static_inputs: frozenset[tuple[str, int]]) -> BreakableRecorder:
        return BreakableRecorder(key, segments)
