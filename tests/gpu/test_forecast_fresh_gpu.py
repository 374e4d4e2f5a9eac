"""The forecast against what a fresh process loses, on four transformers families (issue 36).

Each case is one new interpreter (``tests/gpu/forecast_driver_check.py``'s ``run_case``: one eager
forward, then ``backend.forecast`` and the capture of SGLang's 50 prefill sizes up to 4096 tokens),
for Qwen2, Gemma, GPT-NeoX and Phi-3 (``tests/gpu/forecast_families.py``) x Full, Breakable,
Piecewise x ``off``, ``on``, ``released``. The contract: the forecast's total lands within 2 % of
the free device memory the process lost over forecast and capture, or its caveat says why it may
not (the graph pool depends on the addresses cudaMalloc gives its segments: Qwen2's schedule).
About 20 s a case; split the 36 across device calls by ``-k`` (a family's name). Rows go to
``$SGLANG_BCG_GPU_RESULTS_DIR/forecast_fresh.json``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from forecast_driver_check import _spawned

pytestmark = pytest.mark.cuda

FAMILIES = ("qwen2", "gemma", "gpt_neox", "phi3")
ROWS: list[dict[str, Any]] = []
ADDRESS_CAVEAT = "depends on the addresses cudaMalloc gives its segments"


@pytest.mark.parametrize("mode", ["off", "on", "released"])
@pytest.mark.parametrize("backend", ["full", "breakable", "piecewise"])
@pytest.mark.parametrize("family", FAMILIES)
def test_forecast_is_within_two_percent_of_a_fresh_process_or_says_why(family: str, backend: str, mode: str) -> None:
    got = _spawned((family, backend, mode, 4096, "prefill", "off"), 180.0)
    assert got["ok"], got
    row = got["row"]
    ROWS.append({k: v for k, v in row.items() if k not in ("probes", "forecast", "kept_segments")})
    out = os.environ.get("SGLANG_BCG_GPU_RESULTS_DIR")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, "forecast_fresh.json").write_text(json.dumps(ROWS, indent=1))
    assert row["nodes_check"]["ok"], row["nodes_check"]
    assert "launch_bytes" in row["driver"]  # the first launches were measured
    error = row["forecast_error"]
    assert error is not None
    assert abs(error) <= 0.02 or ADDRESS_CAVEAT in row["caveat"], (family, backend, mode, error, row["caveat"])
