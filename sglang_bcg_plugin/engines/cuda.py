"""CUDA engines: whole-forward graphs (Full) and the segmented engine over CUDA graphs; one private pool
and one capture stream per partition (docs/breakable.md#pools-and-streams)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from .base import CaptureRequest, Engine, Front, run_warmups
from .gcsafe import defer_release, gc_safe_capture
from .cuda_segments import CudaSegments, abort_capture, end_capture, invalidated
from .recorder import SegmentedGraph, host_read_error, record


class FullGraph:
    """One ``torch.cuda.CUDAGraph`` and its static output."""

    num_segments = 1

    def __init__(self, graph: torch.cuda.CUDAGraph, output: Any) -> None:
        self._graph: torch.cuda.CUDAGraph | None = graph
        self.output = output

    def replay(self) -> Any:
        if self._graph is None:
            raise RuntimeError("graph was released; capture it again")
        self._graph.replay()
        return self.output

    def release(self) -> None:
        if self._graph is not None:
            self._graph.reset()
        self._graph = None

    def __del__(self) -> None:
        defer_release([getattr(self, "_graph", None)])  # dropped inside a capture: destroyed after it


class CudaGraphEngine(Engine):
    """Per partition a private pool and a capture stream; warmups on it, then :meth:`_record`."""

    name = "cuda"

    def __init__(self) -> None:
        self._pools: dict[int | None, Any] = {}
        #: one capture stream per partition (cuBLAS keeps one workspace per stream)
        self._streams: defaultdict[int | None, torch.cuda.Stream] = defaultdict(torch.cuda.Stream)
        self._anchors: list[torch.cuda.CUDAGraph] = []
        self._reserve: dict[int | None, int] = {}

    def reserve_pool(self, nbytes: int, partition: int | None = None) -> None:
        """Start ``partition``'s pool, when it is made, with one free block of ``nbytes``."""
        if nbytes > 0 and partition not in self._pools:
            self._reserve[partition] = nbytes

    def pool(self, partition: int | None) -> Any:
        """The partition's private pool, anchored by an empty graph until ``release()`` (a pool whose
        last graph is destroyed is freed: a later ``capture_begin`` on its handle would assert)."""
        if partition not in self._pools:
            handle = torch.cuda.graph_pool_handle()
            anchor = torch.cuda.CUDAGraph()
            with gc_safe_capture(), torch.cuda.stream(self._streams[partition]):
                anchor.capture_begin(pool=handle)
                try:
                    nbytes = self._reserve.pop(partition, 0)
                    if nbytes:  # a segment of its own, dropped at once: a free block of the pool
                        torch.empty(nbytes, dtype=torch.uint8, device="cuda")
                finally:
                    end_capture(anchor)
            self._anchors.append(anchor)
            self._pools[partition] = handle
        return self._pools[partition]

    def capture(self, request: CaptureRequest) -> FullGraph | SegmentedGraph:
        stream = request.stream if request.stream is not None else self._streams[request.partition]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            warm = run_warmups(request)  # noqa: F841 - kept alive until the capture ended (foreign storages)
        torch.cuda.synchronize()
        pool = self.pool(request.partition)
        try:
            with gc_safe_capture(), torch.cuda.stream(stream):
                graph = self._record(request, pool)
        except BaseException:
            if invalidated(pool):  # the partition's later keys go to a fresh pool
                self._pools.pop(request.partition, None)
            raise
        torch.cuda.synchronize()
        return graph

    def _record(self, request: CaptureRequest, pool: Any) -> FullGraph | SegmentedGraph:
        raise NotImplementedError

    def __del__(self) -> None:
        defer_release(getattr(self, "_anchors", ()))

    def release(self) -> None:
        for anchor in self._anchors:
            anchor.reset()
        self._anchors.clear()
        self._pools.clear()
        self._streams.clear()
        self._reserve.clear()


class FullCudaEngine(CudaGraphEngine):
    """One ``torch.cuda.CUDAGraph`` per key, the output policy inside it."""

    def _record(self, request: CaptureRequest, pool: Any) -> FullGraph:
        g = torch.cuda.CUDAGraph()
        g.capture_begin(pool=pool)
        try:
            try:
                output = request.place(request.forward_fn())
            except BaseException:
                abort_capture(g, pool)
                raise
            end_capture(g, pool)
        except BaseException as exc:
            host = host_read_error(exc, request.key, None)  # a host sync: one clear error
            if host is not None and host is not exc:
                raise host from exc
            raise
        return FullGraph(g, output)


class SegmentCudaEngine(CudaGraphEngine):
    """The segmented engine over CUDA graphs: one graph per segment in the partition's pool."""

    def __init__(self, front: Front) -> None:
        super().__init__()
        self.front = front

    def capture(self, request: CaptureRequest) -> FullGraph | SegmentedGraph:
        if request.num_warmups < self.front.min_cuda_warmups:  # compiling inside a capture fails
            raise ValueError(f"this backend on CUDA needs num_warmups >= {self.front.min_cuda_warmups} (got "
                             f"{request.num_warmups}) so torch.compile runs before the capture of {request.key!r}")
        return super().capture(request)

    def _record(self, request: CaptureRequest, pool: Any) -> SegmentedGraph:
        recorder = self.front.recorder(request.key, CudaSegments(pool), request.partition, request.static_inputs)
        return record(recorder, request.forward_fn, request.place)

    def bridge_bytes(self) -> dict[int | None, int]:
        return self.front.bridge_bytes()

    def release(self) -> None:
        super().release()
        self.front.release()
