"""The Breakable front-end of the segment recorder: breaks are ``@graph_break`` functions.

What crosses a break (``docs/breakable.md``) costs no bridge memory and no copy in:

* arguments are passed **as they are**. Every tensor a captured forward hands a break already
  has a stable address: graph-pool memory that this key's segment before the break writes at
  every replay (q, k, v), or memory the caller keeps (static inputs, weights, caches). The
  replay step keeps the arguments named in ``reads``/``writes`` through *non-owning aliases*
  (:func:`~sglang_bcg_plugin.released.alias`) on CUDA, so the pool gets their blocks back once
  the model drops them — later work of this key and later keys reuse them, exactly as a
  whole-forward graph reuses the memory of its dead intermediates. At replay the step reads
  them between the same two segments as at capture, so nothing has overwritten them yet;
* a tensor the function *returns* (allocated by it, outside the graph) gets graph-pool memory
  of its own: an empty tensor like it, allocated as the first thing of the next segment, which
  the forward receives (the step refreshes it at every replay; no clone). A return that aliases
  an argument is stable already and passed as is;
* everything else (unnamed tensors, plain values) is passed as is and held strongly for the
  graph's life.

On the eager segments (CPU machines) nothing is captured, so the returned values are copied into
that memory at once (outside the segment's op tape: the step refreshes it at replay) and
references stay strong (CPU memory is not a graph pool).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from ..released import maybe_alias
from ..trees import flatten, storage_key, unflatten
from .recorder import Recorder, Segments, refresh


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


class BreakableRecorder(Recorder):
    """Records one key of a breakable forward; ``graph_break`` wrappers call :meth:`on_break`."""

    def on_break(
        self,
        fn: Callable[..., Any],
        bound: inspect.BoundArguments,
        reads: frozenset[str],
        writes: frozenset[str],
    ) -> Any:
        if self.in_break:
            return fn(*bound.args, **bound.kwargs)
        args, kwargs = bound.args, bound.kwargs
        arg_keys = {storage_key(t) for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)}
        with self.eager_break():
            result = fn(*args, **kwargs)
        spec, leaves = _flatten_return(fn, result)
        # The next segment is open: returned tensors get pool memory as its first allocations.
        targets = [t if storage_key(t) in arg_keys else torch.empty_like(t) for _, t in leaves]
        with self.segments.paused():  # eager segments: the step refreshes it at replay
            for target, (_, t) in zip(targets, leaves, strict=True):
                if target is not t and not _capturing(target):
                    target.copy_(t)
        named = reads | writes
        kept = inspect.BoundArguments(bound.signature, bound.arguments.copy())
        for name in named & kept.arguments.keys():
            kept.arguments[name] = maybe_alias(kept.arguments[name])
        rets = [maybe_alias(t) for t in targets]
        held = (kept.args, kept.kwargs)  # strong: whatever was not aliased
        self.add_step(_Step(fn, kept.args, kept.kwargs, rets), held)
        return unflatten(spec, targets)


def _break_name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def _flatten_return(
    fn: Callable[..., Any], result: Any, path: str | None = None
) -> tuple[Any, list[tuple[str, torch.Tensor]]]:
    """``flatten`` of what a break returned, its errors naming the break (not "at output");
    ``path``: the leaves' root (default ``name(...)``).

    :raises TypeError: a return value replay cannot track (``trees.flatten``'s reasons)."""
    name = _break_name(fn)
    try:
        return flatten(result, path=f"{name}(...)" if path is None else path)
    except TypeError as exc:
        msg = f"@graph_break function {name} returned a value replay cannot track: {exc}"
        raise TypeError(msg) from None


class _Step:
    """Replay of one break: run the function again and refresh its returned tensors."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], ret_views: list[Any]) -> None:
        self.fn, self.args, self.kwargs, self.ret_views = fn, args, kwargs, ret_views

    def __call__(self) -> None:
        out = self.fn(*self.args, **self.kwargs)
        if not self.ret_views:
            return
        _, new = _flatten_return(self.fn, out, "output")
        if len(new) != len(self.ret_views):
            msg = f"break {self.fn.__qualname__} returned {len(new)} tensors on replay, captured {len(self.ret_views)}"
            raise RuntimeError(msg)
        for view, (path, t) in zip(self.ret_views, new, strict=True):
            refresh(view, t, f"break {self.fn.__qualname__} at {path}")


class BreakableFront:
    """The Breakable front of the segmented engine: no bridges (arguments pass as they are)."""

    min_cuda_warmups = 0

    def recorder(
        self, key: object, segments: Segments, partition: int | None, static_inputs: frozenset[tuple[str, int]]
    ) -> BreakableRecorder:
        return BreakableRecorder(key, segments)

    def bridge_bytes(self) -> dict[int | None, int]:
        return {}

    def release(self) -> None:
        """Nothing held between keys."""
