"""Breakable backend: per key, CUDA-graph segments split at ``@graph_break`` functions (eager
segments on CPU)."""

from __future__ import annotations

from ..engines.base import Engine
from ..engines.breakable import BreakableFront
from ..engines.eager_segments import EagerSegmentEngine
from ..manager import hookimpl
from ..registry import BackendRegistry
from .base import CaptureBackend


class BreakableBackend(CaptureBackend):
    """Breakable CUDA graphs with per-partition output sharing."""

    name = "breakable"

    def _make_eager_engine(self) -> Engine:
        return EagerSegmentEngine(BreakableFront())

    def _make_cuda_engine(self) -> Engine:
        from ..engines.cuda import SegmentCudaEngine

        return SegmentCudaEngine(BreakableFront())


@hookimpl
def sglang_bcg_register_backends(registry: BackendRegistry) -> None:
    registry.add("breakable", BreakableBackend)
