"""The plugin-author API: what a package that adds a backend, an engine or an observer subclasses and
registers (``docs/writing-a-backend.md``, ``docs/hooks.md``); users need only :mod:`sglang_bcg_plugin`."""

from __future__ import annotations

from .backends.base import CaptureBackend
from .backends.breakable import BreakableBackend
from .backends.full import FullBackend
from .backends.piecewise import PiecewiseBackend
from .backends.piecewise.front import PieceFront
from .output.state import CaptureState
from .engines.base import CapturedGraph, CaptureRequest, Engine, Front, run_warmups
from .engines.breakable import BreakableFront
from .engines.cuda import FullCudaEngine, SegmentCudaEngine
from .engines.eager import EagerEngine, EagerSegmentEngine
from .manager import hookimpl
from .registry import BackendRegistry
from .output.policy import OutputPolicy

__all__ = ["BackendRegistry", "BreakableBackend", "BreakableFront", "CaptureBackend", "CaptureRequest", "CaptureState",
           "CapturedGraph", "EagerEngine", "EagerSegmentEngine", "Engine", "Front", "FullBackend", "FullCudaEngine",
           "OutputPolicy", "PieceFront", "PiecewiseBackend", "SegmentCudaEngine", "hookimpl", "run_warmups"]
