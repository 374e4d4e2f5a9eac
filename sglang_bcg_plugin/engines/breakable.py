"""The Breakable front-end of the segment recorder: breaks are ``@graph_break`` functions.

What crosses a break (``docs/breakable.md``):

* arguments named in ``reads``/``writes`` are *bridged* through the partition's
  :class:`~sglang_bcg_plugin.storage.SlotStore`: inside the segment before the break each read
  is copied into a slot (``arg:<function>:<name>``), the function runs on the slot views, and
  inside the segment after it each written slot is copied back. Slots are storage, not rows, so
  one slot per argument name serves every layer and every key of a partition whatever the
  layout (``[tokens, hidden]`` or ``[1, heads, seq, head_dim]``);
* tensors the function *returns* (allocated by it) need a stable address too. A read-only slot
  of this call is dead once the function has run, so a returned tensor that fits one is copied
  there; only the rest get ``ret:`` slots. A break returning its attention output costs no
  bridge memory beyond its inputs;
* everything else (weights, caches, static inputs, plain values) is passed as is and held
  strongly for the graph's life.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from ..storage import SlotStore, view_of
from ..trees import flatten, storage_key, unflatten
from .recorder import Recorder, Segments, refresh


class BreakableRecorder(Recorder):
    """Records one key of a breakable forward; ``graph_break`` wrappers call :meth:`on_break`."""

    def __init__(self, key: object, segments: Segments, bridges: SlotStore) -> None:
        super().__init__(key, segments)
        self.bridges = bridges

    def on_break(
        self,
        fn: Callable[..., Any],
        bound: inspect.BoundArguments,
        reads: frozenset[str],
        writes: frozenset[str],
    ) -> Any:
        if self.in_break:
            return fn(*bound.args, **bound.kwargs)
        bridges, name = self.bridges, fn.__qualname__
        originals: dict[str, torch.Tensor] = {}
        free: list[torch.Tensor] = []  # flat read-only slots of this call: reusable for returns
        for arg in sorted(reads | writes):
            value = bound.arguments.get(arg)
            if not isinstance(value, torch.Tensor):
                continue  # None or not a tensor: passed and held as is
            flat = bridges.slot(f"arg:{name}:{arg}", value)
            view = view_of(flat, value.shape)
            if arg in reads:
                view.copy_(value)  # captured: end of the segment before the break
            if arg not in writes:
                free.append(flat)
            originals[arg] = value
            bound.arguments[arg] = view
        args, kwargs = bound.args, bound.kwargs  # strong references, held by the step
        with self.eager_break():
            result = fn(*args, **kwargs)
            spec, leaves = flatten(result)
            ret_views = self._return_views(name, leaves, free)
            for view, (_, t) in zip(ret_views, leaves, strict=True):
                if view is not t:
                    view.copy_(t)
        self.add_step(_Step(fn, args, kwargs, ret_views), (args, kwargs, ret_views))
        for arg, original in originals.items():
            if arg in writes:
                original.copy_(bound.arguments[arg])  # captured: start of the next segment
        # The forward gets copies made inside the next segment: the slots are reused by the
        # next break, but the model may keep what this one returned (residuals).
        fresh = [
            v.clone() if isinstance(v, torch.Tensor) and v is not t else v
            for v, (_, t) in zip(ret_views, leaves, strict=True)
        ]
        return unflatten(spec, fresh)

    def _return_views(self, name: str, leaves: list[tuple[str, Any]], free: list[torch.Tensor]) -> list[Any]:
        """Stable storage for each returned tensor: a dead read-only slot, else a ``ret:`` slot."""
        slots = {storage_key(f) for f in free}
        if any(storage_key(t) in slots for _, t in leaves):
            free = []  # a returned tensor aliases an argument slot: reuse nothing
        views: list[Any] = []
        for path, t in leaves:
            i = next(
                (i for i, f in enumerate(free) if f.dtype == t.dtype and f.device == t.device and f.numel() >= t.numel()),
                None,
            )
            if i is not None:
                views.append(view_of(free.pop(i), t.shape))
            else:
                views.append(self.bridges.view(f"ret:{name}:{path}", t))
        return views


class _Step:
    """Replay of one break: run the function again and refresh its returned tensors."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], ret_views: list[Any]) -> None:
        self.fn, self.args, self.kwargs, self.ret_views = fn, args, kwargs, ret_views

    def __call__(self) -> None:
        out = self.fn(*self.args, **self.kwargs)
        if not self.ret_views:
            return
        _, new = flatten(out)
        for view, (path, t) in zip(self.ret_views, new, strict=True):
            refresh(view, t, f"break {self.fn.__qualname__} at {path}")
