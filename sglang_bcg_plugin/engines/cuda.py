"""CUDA engines: whole-forward graphs (Full) and segmented breakable graphs.

One private graph pool, one bridge arena and one capture stream per stream partition: graphs
of one partition never replay concurrently, so they may reuse each other's intermediate memory;
graphs of different partitions may, so they share neither a pool nor a capture stream (cuBLAS
workspaces are per stream). A session's ``stream`` overrides the capture stream. Warmups run on the capture stream, each followed by ``post_warmup_hook``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from ..breaks import reset_recorder, set_recorder
from .base import CaptureRequest, run_warmups
from .gcsafe import gc_safe_capture
from .segments import BridgeArena, SegmentRecorder


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


class SegmentedGraph:
    """Segments ``g0, g1, ..., gN`` with eager steps between them: g0, s0, g1, s1, ..., gN."""

    def __init__(
        self, graphs: list[torch.cuda.CUDAGraph | None], steps: list[Callable[[], None]], output: Any
    ) -> None:
        self._graphs: list[torch.cuda.CUDAGraph | None] | None = graphs
        self._steps = steps
        self.output = output
        self.num_segments = len(graphs)

    def replay(self) -> Any:
        graphs = self._graphs
        if graphs is None:
            msg = "graph was released; capture it again"
            raise RuntimeError(msg)
        steps = self._steps
        for i, g in enumerate(graphs):
            if g is not None:
                g.replay()
            if i < len(steps):
                steps[i]()
        return self.output

    def release(self) -> None:
        for g in self._graphs or ():
            if g is not None:
                g.reset()
        self._graphs = None
        self._steps = []


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


class CudaGraphEngine:
    """Captures ``torch.cuda.CUDAGraph`` objects; ``segmented`` enables graph breaks."""

    name = "cuda"

    def __init__(self, *, segmented: bool) -> None:
        self.segmented = segmented
        self._pools: dict[int | None, Any] = {}
        self._arenas: dict[int | None, BridgeArena] = {}
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

    def arena(self, partition: int | None) -> BridgeArena:
        if partition not in self._arenas:
            self._arenas[partition] = BridgeArena()
        return self._arenas[partition]

    def _capture_stream(self, request: CaptureRequest) -> torch.cuda.Stream:
        if request.stream is not None:
            return request.stream  # type: ignore[no-any-return]
        return self._partition_stream(request.partition)

    def capture(self, request: CaptureRequest) -> FullGraph | SegmentedGraph:
        stream = self._capture_stream(request)
        current = torch.cuda.current_stream()
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            run_warmups(request)
        torch.cuda.synchronize()
        pool = self.pool(request.partition)
        with gc_safe_capture(), torch.cuda.stream(stream):
            if self.segmented:
                graph: FullGraph | SegmentedGraph = self._capture_segmented(request, pool, stream)
            else:
                graph = self._capture_full(request, pool)
        torch.cuda.synchronize()
        return graph

    def _capture_full(self, request: CaptureRequest, pool: Any) -> FullGraph:
        g = torch.cuda.CUDAGraph()
        g.capture_begin(pool=pool)
        try:
            output = request.finalize(request.forward_fn())
        except BaseException:
            _abort(g)
            raise
        end_capture(g)
        return FullGraph(g, output)

    def _capture_segmented(self, request: CaptureRequest, pool: Any, stream: torch.cuda.Stream) -> SegmentedGraph:
        recorder = SegmentRecorder(pool, self.arena(request.partition))
        token = set_recorder(recorder)
        try:
            recorder.begin()
            output = request.finalize(request.forward_fn())
            recorder.end()
        except BaseException:
            recorder.abort()
            raise
        finally:
            reset_recorder(token)
        return SegmentedGraph(recorder.graphs, recorder.steps, output)

    def release(self) -> None:
        for anchor in self._anchors:
            anchor.reset()
        self._anchors.clear()
        self._pools.clear()
        self._arenas.clear()
        self._streams.clear()


def _abort(graph: torch.cuda.CUDAGraph) -> None:
    """End a failed capture so the stream is not left capturing; the graph is discarded."""
    try:
        graph.capture_end()
    except Exception:  # noqa: BLE001,S110 - the capture is already invalid; the caller re-raises
        pass
    try:
        graph.reset()
    except Exception:  # noqa: BLE001,S110
        pass
