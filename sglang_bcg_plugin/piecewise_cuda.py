"""CUDA engine of the piecewise backend: one ``torch.cuda.CUDAGraph`` per piece per key.

Warmups run eagerly on the capture stream first (each followed by ``post_warmup_hook``); the
first one also triggers the ``torch.compile`` compilation, so it never happens inside a capture.
Then one recorded forward (``piecewise_record``): every segment is a graph in the partition's
pool (``CudaGraphEngine.pool``), bridges live in the partition's arena (``CudaGraphEngine.arena``).
Keys of one partition never replay concurrently, so they may reuse each other's intermediate
memory and bridge slots; different partitions never share either.
"""

from __future__ import annotations

from typing import Any

import torch

from .engines.base import CaptureRequest, run_warmups
from .engines.cuda import CudaGraphEngine, _abort, end_capture
from .engines.gcsafe import gc_safe_capture
from .piecewise_record import Action, PiecewiseGraph, PieceRecorder, record


class CudaSegments:
    """Each segment is one ``torch.cuda.CUDAGraph`` in the partition's pool (None if empty)."""

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

    def abort(self) -> None:
        if self._current is not None:
            _abort(self._current)
            self._current = None
        self.release()

    def runners(self) -> list[Action | None]:
        return [None if g is None else g.replay for g in self.graphs]

    def release(self) -> None:
        for g in self.graphs:
            if g is not None:
                g.reset()
        self.graphs.clear()


class PiecewiseCudaEngine(CudaGraphEngine):
    """One CUDA graph per piece per key; splitting ops run eagerly between the graphs."""

    def __init__(self) -> None:
        super().__init__(segmented=False)

    def capture(  # type: ignore[override]
        self, request: CaptureRequest, known_inputs: frozenset[tuple[str, int]] = frozenset()
    ) -> PiecewiseGraph:
        if request.num_warmups < 1:
            # dynamo (re)compiles on a call that misses its cache, and compiling reads the CUDA
            # RNG state, which is illegal inside a capture: a warmup must make that call first.
            msg = (
                f"piecewise backend on CUDA needs num_warmups >= 1 (got {request.num_warmups}) so "
                f"torch.compile runs before the capture of {request.key!r}"
            )
            raise ValueError(msg)
        stream = self._capture_stream(request)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run_warmups(request)
        torch.cuda.synchronize()
        segments = CudaSegments(self.pool(request.partition))
        recorder = PieceRecorder(request.key, segments, self.arena(request.partition), known_inputs)
        with gc_safe_capture(), torch.cuda.stream(stream):
            graph = record(recorder, request.forward_fn, request.finalize)
        torch.cuda.synchronize()
        return graph
