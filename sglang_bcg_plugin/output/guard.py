"""Stale-output guard: poison what an earlier replay handed out once another graph of its scope
(a backend's partition, or a graph pool in mode ``released``) replayed (docs/reliability.md)."""

from __future__ import annotations

import threading
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

from . import released as _released
from .released import alias, maybe_alias, released_supported
from .trees import flatten, unflatten


def guard_supported() -> bool:
    """Whether this torch build can poison storages."""
    return hasattr(torch._C, "_set_storage_access_error_msg") and released_supported()


@dataclass(eq=False)
class _Handout:
    owner: int
    key: Hashable
    tensors: list[torch.Tensor]
    released: bool


def _message(prev: _Handout, key: Hashable) -> str:
    if prev.released:
        return (f"stale output: this view was returned by replay({prev.key!r}) in output mode 'released' (it lives in "
                f"free graph-pool memory) and replay({key!r}), another graph of the same pool, has since run and may "
                "have overwritten it; read or clone a released output before any other graph of the pool replays")
    return (f"stale output: this view was returned by replay({prev.key!r}) and its memory has since been rewritten by "
            f"replay({key!r}) of the same partition; clone outputs you keep across replays")


class StaleOutputGuard:
    """Per scope (a backend's partition, a graph pool), the output handed out last."""

    def __init__(self) -> None:
        self._last: dict[Hashable, _Handout] = {}
        self._lock = threading.Lock()

    def hand_out(self, owner: object, key: Hashable, output: Any, *, released: bool,
                 pool: Hashable | None = None) -> Any:
        """``owner`` replayed ``key``'s graph: poison what the previous replay of another graph of its
        scope handed out (``released``: of ``pool``, ``None`` for the owner's partition; otherwise of
        the partition); return ``output`` as fresh aliases, remembered."""
        partition = (id(owner), getattr(key, "stream_idx", None))
        in_pool = partition if pool is None else ("pool", pool)
        with self._lock:
            for scope in (in_pool,) if released else (in_pool, partition):
                prev = self._last.get(scope)
                if prev is not None and (prev.owner, prev.key) != (id(owner), key):
                    for t in prev.tensors:
                        torch._C._set_storage_access_error_msg(t, _message(prev, key))
                    del self._last[scope]
            spec, leaves = flatten(output)
            fresh = [maybe_alias(t) if released else alias(t) for _, t in leaves]
            kept = [t for t in fresh if not released or t.device.type in _released.ALIAS_DEVICE_TYPES]
            self._last[in_pool if released else partition] = _Handout(id(owner), key, kept, released)
            return unflatten(spec, fresh)

    def forget(self, owner: object) -> None:
        """Drop the records of ``owner`` (its ``cleanup()``)."""
        with self._lock:
            for scope in [s for s, h in self._last.items() if h.owner == id(owner)]:
                del self._last[scope]


#: The one guard of the process (SGLang's graph pool is process-global).
GUARD = StaleOutputGuard()
