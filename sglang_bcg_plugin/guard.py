"""Stale-output guard: poison views handed out by an earlier replay of another key.

With output sharing, key B's replay overwrites the memory key A's earlier output views point
to. With the guard on, every replay hands out tensors backed by *fresh* storage objects that
alias the graph's output memory, and the storage objects handed out by the previous replay of
another key of the same partition are poisoned: touching their data raises ``RuntimeError``
naming both keys (the approach of torch's CUDA Graph Trees).

Needs ``torch._C._set_storage_access_error_msg`` and
``torch._C._construct_storage_from_data_pointer`` (CUDA builds of torch). Where they are
missing the guard warns once, when the backend opens a capture session, and does nothing.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

from .released import alias
from .trees import flatten, unflatten


def guard_supported() -> bool:
    """Whether this torch build can poison storages."""
    return hasattr(torch._C, "_set_storage_access_error_msg") and hasattr(
        torch._C, "_construct_storage_from_data_pointer"
    )


class StaleOutputGuard:
    """Per-partition record of the last handed-out views."""

    def __init__(self) -> None:
        self._last: dict[Any, tuple[Hashable, list[torch.Tensor]]] = {}

    def hand_out(self, key: Hashable, output: Any) -> Any:
        """Poison the previous other key's views of this partition; return fresh aliases."""
        partition = getattr(key, "stream_idx", None)
        prev = self._last.get(partition)
        if prev is not None and prev[0] != key:
            msg = (
                f"stale output: this view was returned by replay({prev[0]!r}) and its memory has "
                f"since been rewritten by replay({key!r}) of the same partition; clone outputs "
                "you keep across replays"
            )
            for t in prev[1]:
                torch._C._set_storage_access_error_msg(t, msg)
        spec, leaves = flatten(output)
        fresh = [alias(t) for _, t in leaves]
        self._last[partition] = (key, fresh)
        return unflatten(spec, fresh)

    def clear(self) -> None:
        self._last.clear()
