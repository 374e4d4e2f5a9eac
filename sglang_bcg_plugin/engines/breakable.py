"""The Breakable front of the segment recorder: breaks are ``@graph_break`` functions (what crosses a
break, and why it costs no bridge memory: docs/breakable.md)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from ..output.released import maybe_alias
from ..output.trees import flatten, storage_key, unflatten
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
        step = _Step(f"break {fn.__qualname__}", fn, kept.args, kept.kwargs, [maybe_alias(t) for t in targets])
        self.add_step(step, (step.args, step.kwargs))  # strong: whatever was not aliased
        return unflatten(spec, targets)


def _flatten_return(fn: Callable[..., Any], result: Any,
                    path: str | None = None) -> tuple[Any, list[tuple[str, torch.Tensor]]]:
    """``flatten`` of what break ``fn`` returned, rooted at ``path`` (default ``name(...)``).
    :raises TypeError: a return value replay cannot track, naming the break."""
    name = getattr(fn, "__qualname__", None) or repr(fn)
    try:
        return flatten(result, path=f"{name}(...)" if path is None else path)
    except TypeError as exc:
        msg = f"@graph_break function {name} returned a value replay cannot track: {exc}"
        raise TypeError(msg) from None


class _Step(Rerun):
    """Replay of one break: run the function again and refresh its returned tensors (``outs``)."""

    __slots__ = ()

    def __call__(self) -> None:
        out = self.fn(*self.args, **self.kwargs)
        if not self.outs:
            return
        _, new = _flatten_return(self.fn, out, "output")
        if len(new) != len(self.outs):
            msg = f"{self.what} returned {len(new)} tensors on replay, captured {len(self.outs)}"
            raise RuntimeError(msg)
        for view, (path, t) in zip(self.outs, new, strict=True):
            refresh(view, t, f"{self.what} at {path}")


class BreakableFront(Front):
    """The Breakable front of the segmented engine: no bridges (arguments pass as they are)."""

    def recorder(self, key: object, segments: Segments, partition: int | None,
                 static_inputs: frozenset[tuple[str, int]]) -> BreakableRecorder:
        return BreakableRecorder(key, segments)
