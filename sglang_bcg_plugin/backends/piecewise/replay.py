"""Engines of the piecewise backend: record one forward per key, replay its pieces (CUDA in
:mod:`.cuda`).

Both engines run the warmups first (each followed by ``post_warmup_hook``); the first one also
triggers the ``torch.compile`` compilation, so it never happens inside a capture. Then one
recorded forward (:mod:`.record`) through the shared segment recorder:

* CUDA: every segment is one ``torch.cuda.CUDAGraph`` in the partition's pool
  (``CudaGraphEngine.pool``), bridges live in the partition's bridge store. Keys of one
  partition never replay concurrently, so they may reuse each other's intermediate memory and
  bridge slots; different partitions never share either.
* eager (CPU machines): each piece's outputs become static storage; replay re-runs the pieces in
  order and writes into that storage, with the splitting ops eager between them, exactly as
  CUDA-graph pieces would.
"""

from __future__ import annotations

from ...engines.base import CaptureRequest, run_warmups
from ...engines.recorder import SegmentedGraph, record
from ...engines.tape import EagerSegments
from ...storage import PartitionStores
from .record import PieceRecorder


class PiecewiseEagerEngine:
    """Pieces re-run at replay and write into their captured outputs (no CUDA needed)."""

    name = "eager"

    def __init__(self) -> None:
        self.bridges = PartitionStores()

    def bridge_bytes(self) -> dict[int | None, int]:
        return self.bridges.nbytes()

    def capture(self, request: CaptureRequest) -> SegmentedGraph:
        warmed = run_warmups(request)
        recorder = PieceRecorder(request.key, EagerSegments(), self.bridges(request.partition), request.static_inputs)
        return record(recorder, request.forward_fn, warmed.finalize(request))

    def release(self) -> None:
        self.bridges.clear()
