"""Pluggable CUDA-graph capture backends for SGLang, with switchable output sharing."""

from __future__ import annotations

from ._constants import ENV_SHARE_OUTPUT, NAME
from ._version import __version__
from .backends.base import CaptureBackend
from .breaks import graph_break
from .errors import (BackendRegistrationError, CaptureStateError, ForecastError, GraphBreakError, HostReadError,
                     ObserverError, ObserverWarning, OutputStructureError, PluginLoadWarning)
from .manager import BrokenPlugin, get_plugin_manager, hookimpl
from .options import BackendOptions
from .output.mode import resolve_output_mode
from .output.report import KeyReport, MemoryReport
from .registry import BackendRegistry, available_backends, broken_plugins, create_backend
from .shape_key import ShapeKey
from .output.policy import SharedOutputFallbackWarning

__all__ = ["ENV_SHARE_OUTPUT", "NAME", "BackendOptions", "BackendRegistrationError", "BackendRegistry", "BrokenPlugin",
           "CaptureBackend", "CaptureStateError", "ForecastError", "GraphBreakError", "HostReadError", "KeyReport",
           "MemoryReport", "ObserverError", "ObserverWarning", "OutputStructureError", "PluginLoadWarning", "ShapeKey",
           "SharedOutputFallbackWarning", "__version__", "available_backends", "broken_plugins", "create_backend",
           "get_plugin_manager", "graph_break", "hookimpl", "resolve_output_mode"]
