"""CUDA engines: whole-forward graphs (Full) and segmented breakable graphs.

One private graph pool, one bridge store and one capture stream per stream partition: graphs
of one partition never replay concurrently, so they may reuse each other's intermediate memory;
graphs of different partitions may, so they share neither a pool nor a capture stream (cuBLAS
workspaces are per stream). A session's ``stream`` overrides the capture stream. Warmups run on
the capture stream, each followed by ``post_warmup_hook``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..storage import PartitionStores
from .base import CaptureRequest, run_warmups
from .breakable import BreakableRecorder
from .gcsafe import defer_release, gc_safe_capture
from .graphs import CudaSegments, abort_capture, end_capture
from .recorder import SegmentedGraph, record


class FullGraph:
    """One ``torch.cuda.CUDAGraph`` and its static output."""

    num_segments = 1

    def __init__(self, graph: torch.cuda.CUDAGraph, output: Any) -> None:
        self._graph: torch.cuda.CUDAGraph | None = graph
        self.output = output

    def replay(self) -> Any:
        if self._graph is None:
            msg = "graph was released; capture it again"
            raise RuntimeError(msg)
        self._graph.replay()
        return self.output

    def release(self) -> None:
        if self._graph is not None:
            self._graph.reset()
        self._graph = None

    def __del__(self) -> None:
        defer_release([getattr(self, "_graph", None)])  # dropped inside a capture: destroyed after it


class CudaGraphEngine:
    """Captures ``torch.cuda.CUDAGraph`` objects; ``segmented`` enables graph breaks."""

    name = "cuda"

    def __init__(self, *, segmented: bool) -> None:
        self.segmented = segmented
        self._pools: dict[int | None, Any] = {}
        #: The bridge storage of each partition (tensors crossing breaks or splitting ops).
        self.bridges = PartitionStores()
        self._streams: dict[int | None, torch.cuda.Stream] = {}
        self._anchors: list[torch.cuda.CUDAGraph] = []

    def pool(self, partition: int | None) -> Any:
        """The partition's private pool, anchored by an empty graph for the engine's lifetime.

        A pool is freed when its last graph is destroyed, and a later ``capture_begin`` on the
        same handle then trips an allocator assert. Dropped empty segments and rolled-back
        captures destroy graphs, so an empty anchor graph keeps every pool alive until
        ``release()``.
        """
        if partition not in self._pools:
            handle = torch.cuda.graph_pool_handle()
            anchor = torch.cuda.CUDAGraph()
            with gc_safe_capture(), torch.cuda.stream(self._partition_stream(partition)):
                anchor.capture_begin(pool=handle)
                end_capture(anchor)
            self._anchors.append(anchor)
            self._pools[partition] = handle
        return self._pools[partition]

    def _partition_stream(self, partition: int | None) -> torch.cuda.Stream:
        """One capture stream per partition: cuBLAS keeps one workspace per (handle, stream), and
        graphs captured on one stream share it, so graphs of partitions that replay concurrently
        must not be captured on the same stream."""
        if partition not in self._streams:
            self._streams[partition] = torch.cuda.Stream()
        return self._streams[partition]

    def bridge_bytes(self) -> dict[int | None, int]:
        return self.bridges.nbytes()

    def _capture_stream(self, request: CaptureRequest) -> torch.cuda.Stream:
        if request.stream is not None:
            return request.stream  # type: ignore[no-any-return]
        return self._partition_stream(request.partition)

    def capture(self, request: CaptureRequest) -> FullGraph | SegmentedGraph:
        stream = self._capture_stream(request)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            warmed = run_warmups(request)
        torch.cuda.synchronize()
        pool = self.pool(request.partition)
        finalize = warmed.finalize(request)
        with gc_safe_capture(), torch.cuda.stream(stream):
            if self.segmented:
                recorder = BreakableRecorder(request.key, CudaSegments(pool))
                graph: FullGraph | SegmentedGraph = record(recorder, request.forward_fn, finalize)
            else:
                graph = self._capture_full(request.forward_fn, finalize, pool)
        torch.cuda.synchronize()
        return graph

    @staticmethod
    def _capture_full(forward_fn: Callable[[], Any], finalize: Callable[[Any], Any], pool: Any) -> FullGraph:
        g = torch.cuda.CUDAGraph()
        g.capture_begin(pool=pool)
        try:
            output = finalize(forward_fn())
        except BaseException:
            abort_capture(g)
            raise
        end_capture(g)
        return FullGraph(g, output)

    def __del__(self) -> None:
        defer_release(getattr(self, "_anchors", ()))

    def release(self) -> None:
        for anchor in self._anchors:
            anchor.reset()
        self._anchors.clear()
        self._pools.clear()
        self.bridges.clear()
        self._streams.clear()
