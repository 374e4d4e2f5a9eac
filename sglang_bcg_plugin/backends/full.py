"""Full backend: one ``torch.cuda.CUDAGraph`` per shape key."""

from __future__ import annotations

from ..manager import hookimpl
from ..registry import BackendRegistry
from .base import CaptureBackend


class FullBackend(CaptureBackend):
    """One whole-forward CUDA graph per key; graphs of a partition share one pool."""

    name = "full"


@hookimpl
def sglang_bcg_register_backends(registry: BackendRegistry) -> None:
    registry.add("full", FullBackend)
