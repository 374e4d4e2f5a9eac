"""Names only the SGLang integration reads: its environment variables.

The core's one public switch, ``SGLANG_ENABLE_BCG_SHARED_OUTPUT``, stays in
:mod:`sglang_bcg_plugin._constants` (our standalone backends honour it too).
"""

from __future__ import annotations

#: Environment variable that turns the stale-output guard on for the SGLang-integrated backend
#: (which keeps SGLang's constructor, so it has no ``BackendOptions``).
ENV_STALE_OUTPUT_GUARD = "SGLANG_BCG_STALE_OUTPUT_GUARD"

#: Environment variable that overrides where the SGLang-integrated backend's shared buffer
#: comes from (``adopt`` or ``reserve``); unset: ``reserve``. Our own backends take
#: ``BackendOptions(shared_buffer=...)``.
ENV_SHARED_BUFFER = "SGLANG_BCG_SHARED_BUFFER"

#: Environment variable that turns the graph memory forecast lines inside SGLang on (``1``); off
#: by default.
ENV_FORECAST = "SGLANG_BCG_FORECAST"
#: A JSON file: per size, what the capture took from free memory, the pool and the driver.
ENV_FORECAST_TRACE = "SGLANG_BCG_FORECAST_TRACE"
