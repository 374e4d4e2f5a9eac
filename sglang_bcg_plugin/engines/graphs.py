"""CUDA-graph primitives shared by every segmented capture: segments, end, abort (CUDA only)."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch

from .gcsafe import defer_release
from .recorder import Action


def end_capture(graph: torch.cuda.CUDAGraph) -> bool:
    """End a capture; returns False when the segment captured no work (it is not replayed)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph.capture_end()
    empty = False
    for w in caught:
        if "empty" in str(w.message).lower():
            empty = True
        else:  # pragma: no cover - re-emit anything unexpected
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return not empty


def abort_capture(graph: torch.cuda.CUDAGraph) -> None:
    """End a failed capture so the stream is not left capturing; the graph is discarded."""
    try:
        graph.capture_end()
    except Exception:  # noqa: BLE001,S110 - the capture is already invalid; the caller re-raises
        pass
    try:
        graph.reset()
    except Exception:  # noqa: BLE001,S110
        pass


class CudaSegments:
    """Each segment is one ``torch.cuda.CUDAGraph`` in the partition's pool (None if empty)."""

    #: The kernels are in the graphs: recorded actions are never re-run, nothing need be kept.
    reruns_actions = False

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.graphs: list[torch.cuda.CUDAGraph | None] = []
        self._current: torch.cuda.CUDAGraph | None = None

    def begin(self) -> None:
        g = torch.cuda.CUDAGraph()
        g.capture_begin(pool=self.pool)
        self._current = g

    def end(self) -> None:
        g, self._current = self._current, None
        assert g is not None
        self.graphs.append(g if end_capture(g) else None)

    def record(self, action: Action) -> None:
        """Nothing to do: the kernels are in the open graph."""

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """Nothing to pause: a CUDA graph records every kernel on the capturing stream."""
        return contextlib.nullcontext()

    def abort(self) -> None:
        if self._current is not None:
            abort_capture(self._current)
            self._current = None
        self.release()

    def runners(self) -> list[Action | None]:
        return [None if g is None else g.replay for g in self.graphs]

    def release(self) -> None:
        for g in self.graphs:
            if g is not None:
                g.reset()
        self.graphs.clear()

    def __del__(self) -> None:
        defer_release([*getattr(self, "graphs", ()), getattr(self, "_current", None)])  # dropped inside a capture: destroyed after it
