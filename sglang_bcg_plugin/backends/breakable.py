"""Breakable backend: per key, CUDA-graph segments split at ``@graph_break`` functions (eager segments on CPU)."""

from __future__ import annotations

from ..engines.breakable import BreakableFront
from ..manager import hookimpl
from ..registry import BackendRegistry
from .base import CaptureBackend


class BreakableBackend(CaptureBackend):
    """Breakable CUDA graphs with per-partition output sharing."""

    name = "breakable"
    _front = BreakableFront


@hookimpl
def sglang_bcg_register_backends(registry: BackendRegistry) -> None:
    registry.add("breakable", BreakableBackend)
