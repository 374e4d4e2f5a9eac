"""The segmented engine over eager segments (the op tape of :mod:`.tape`), for either front."""

from __future__ import annotations

from .base import CaptureRequest, Front, run_warmups
from .recorder import SegmentedGraph, record
from .tape import EagerSegments


class EagerSegmentEngine:
    """Segments of ops recorded on the eager tape; the front's breaks run eagerly between them."""

    name = "eager"

    def __init__(self, front: Front) -> None:
        self.front = front

    def capture(self, request: CaptureRequest) -> SegmentedGraph:
        warm = run_warmups(request)  # kept alive until the output is placed (foreign storages)
        recorder = self.front.recorder(request.key, EagerSegments(request.key), request.partition, request.static_inputs)
        graph = record(recorder, request.forward_fn, request.place)
        del warm
        return graph

    def release(self) -> None:
        self.front.release()

    def bridge_bytes(self) -> dict[int | None, int]:
        return self.front.bridge_bytes()
