"""Segment recording for breakable graphs, and the per-partition bridge arena."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from ..trees import flatten, unflatten


class BridgeArena:
    """Max-size slots for tensors crossing breaks, shared by every break and key of a partition.

    A slot is identified by (argument name, dtype, trailing shape, device); when a larger row
    count arrives (capture not largest-first) a new, larger slot is added and older graphs keep
    the slot they were captured with.
    """

    def __init__(self) -> None:
        self._slots: dict[tuple[Any, ...], list[torch.Tensor]] = {}

    def view(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """A ``like``-shaped view of a slot; allocates (inside the running capture) if needed."""
        if like.dim() == 0:
            sig: tuple[Any, ...] = (name, like.dtype, None, str(like.device))
            for slot in self._slots.get(sig, ()):
                return slot
        else:
            sig = (name, like.dtype, tuple(like.shape[1:]), str(like.device))
            rows = like.shape[0]
            for slot in self._slots.get(sig, ()):
                if slot.shape[0] >= rows:
                    return slot[:rows]
        slot = torch.empty(like.shape, dtype=like.dtype, device=like.device)
        self._slots.setdefault(sig, []).append(slot)
        return slot

    def nbytes(self) -> int:
        return sum(s.numel() * s.element_size() for slots in self._slots.values() for s in slots)


def _bridgeable(t: object) -> bool:
    return isinstance(t, torch.Tensor)


class SegmentRecorder:
    """Records ``graph, step, graph, step, ..., graph`` for one key."""

    def __init__(self, pool: Any, arena: BridgeArena) -> None:
        self.pool = pool
        self.arena = arena
        self.graphs: list[torch.cuda.CUDAGraph | None] = []
        self.steps: list[Callable[[], None]] = []
        self._current: torch.cuda.CUDAGraph | None = None
        self._in_break = False

    def begin(self) -> None:
        g = torch.cuda.CUDAGraph()
        g.capture_begin(pool=self.pool)
        self._current = g

    def end(self) -> None:
        from .cuda import end_capture

        g, self._current = self._current, None
        assert g is not None
        self.graphs.append(g if end_capture(g) else None)

    def abort(self) -> None:
        from .cuda import _abort

        if self._current is not None:
            _abort(self._current)
            self._current = None
        for g in self.graphs:
            if g is not None:
                g.reset()
        self.graphs.clear()
        self.steps.clear()

    def on_break(
        self,
        fn: Callable[..., Any],
        bound: inspect.BoundArguments,
        reads: frozenset[str],
        writes: frozenset[str],
    ) -> Any:
        if self._in_break or self._current is None:
            return fn(*bound.args, **bound.kwargs)
        arena = self.arena
        originals: dict[str, torch.Tensor] = {}
        for name in sorted(reads | writes):
            value = bound.arguments.get(name)
            if not _bridgeable(value):
                continue  # None or not a tensor: passed and held as is
            assert isinstance(value, torch.Tensor)
            view = arena.view(f"arg:{fn.__qualname__}:{name}", value)
            if name in reads:
                view.copy_(value)  # captured: end of the segment before the break
            originals[name] = value
            bound.arguments[name] = view
        self.end()
        args, kwargs = bound.args, bound.kwargs  # strong references, held by the step
        self._in_break = True
        try:
            result = fn(*args, **kwargs)
        finally:
            self._in_break = False
        spec, leaves = flatten(result)
        ret_views = [arena.view(f"ret:{fn.__qualname__}:{path}", t) if _bridgeable(t) else t for path, t in leaves]
        for view, (_, t) in zip(ret_views, leaves, strict=True):
            if view is not t:
                view.copy_(t)

        def step() -> None:
            out = fn(*args, **kwargs)
            if ret_views:
                _, new = flatten(out)
                for view, (path, t) in zip(ret_views, new, strict=True):
                    if view.shape != t.shape:
                        msg = (
                            f"break {fn.__qualname__} returned shape {tuple(t.shape)} at {path} on "
                            f"replay, captured {tuple(view.shape)}"
                        )
                        raise RuntimeError(msg)
                    if view is not t:
                        view.copy_(t)

        self.steps.append(step)
        self.begin()
        for name, original in originals.items():
            if name in writes:
                original.copy_(bound.arguments[name])  # captured: start of the next segment
        fresh = [v.clone() if isinstance(v, torch.Tensor) and v is not t else v for v, (_, t) in zip(ret_views, leaves, strict=True)]
        return unflatten(spec, fresh)
