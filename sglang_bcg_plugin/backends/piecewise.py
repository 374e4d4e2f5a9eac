"""Piecewise backend (work in progress, issue 5)."""

from __future__ import annotations

from ..engines.base import Engine
from ..manager import hookimpl
from ..registry import BackendRegistry
from .base import CaptureBackend


class PiecewiseBackend(CaptureBackend):
    name = "piecewise"

    def _make_cuda_engine(self) -> Engine:
        from ..engines.cuda import CudaGraphEngine

        return CudaGraphEngine(segmented=False)


@hookimpl
def sglang_bcg_register_backends(registry: BackendRegistry) -> None:
    registry.add("piecewise", PiecewiseBackend)
