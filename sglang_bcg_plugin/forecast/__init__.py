"""Graph-memory forecasts before capture (``CaptureBackend.forecast``; docs/forecast.md)."""

from __future__ import annotations

from .allocator import PoolModel, round_size, segment_size
from .driver import DRIVER_COEFFICIENTS, DriverCoefficients, DriverShare
from .model import MODES, ModeForecast, forecast_modes, simulate
from .trace import KeyTrace, ScaledTrace, pool_trace

__all__ = ["DRIVER_COEFFICIENTS", "MODES", "DriverCoefficients", "DriverShare", "KeyTrace", "ModeForecast", "PoolModel",
           "ScaledTrace", "forecast_modes", "pool_trace", "round_size", "segment_size", "simulate"]
