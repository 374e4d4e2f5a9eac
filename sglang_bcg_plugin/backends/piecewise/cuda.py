"""CUDA engine of the piecewise backend (see :mod:`.replay`): one graph per piece per key."""

from __future__ import annotations

import torch

from ...engines.base import CaptureRequest, run_warmups
from ...engines.cuda import CudaGraphEngine
from ...engines.gcsafe import gc_safe_capture
from ...engines.graphs import CudaSegments
from ...engines.recorder import SegmentedGraph, record
from .record import PieceRecorder


class PiecewiseCudaEngine(CudaGraphEngine):
    """One CUDA graph per piece per key; splitting ops run eagerly between the graphs."""

    def __init__(self) -> None:
        super().__init__(segmented=False)

    def capture(self, request: CaptureRequest) -> SegmentedGraph:  # type: ignore[override]
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
            warmed = run_warmups(request)
        torch.cuda.synchronize()
        segments = CudaSegments(self.pool(request.partition))
        recorder = PieceRecorder(request.key, segments, self.bridges(request.partition), request.static_inputs)
        with gc_safe_capture(), torch.cuda.stream(stream):
            graph = record(recorder, request.forward_fn, warmed.finalize(request))
        torch.cuda.synchronize()
        return graph
