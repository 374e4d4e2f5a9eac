"""Graph-memory forecasts: a model of the caching allocator, allocation traces that scale with
the capture size, and the probe captures that measure them (``CaptureBackend.forecast``)."""

from __future__ import annotations

from .allocator import PoolModel, round_size, segment_size
from .model import MODES, ModeForecast, forecast_modes, simulate
from .trace import KeyTrace, ScaledTrace, pool_trace

__all__ = ["MODES", "KeyTrace", "ModeForecast", "PoolModel", "ScaledTrace", "forecast_modes", "pool_trace",
           "round_size", "segment_size", "simulate"]
