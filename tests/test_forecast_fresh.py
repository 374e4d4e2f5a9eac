"""The forecast against what fresh processes lost on the H200, rebuilt offline from their probes.

``tests/data/forecast/h200_fresh_processes.json.gz`` holds, per process of
``tests/gpu/forecast_driver_check.py`` (one fresh process per model x backend x mode: the synthetic
decoder at 38 sizes, and the four transformers families of ``tests/gpu/forecast_families.py`` at 50
sizes up to 4096 tokens), the probes' pool events, the graphs and nodes the probes counted, the
probes' own stream cost, and the free device memory the process lost over forecast and capture.
Each test rebuilds the forecast from those as ``forecast_schedule`` does on the device.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from sglang_bcg_plugin.forecast import ScaledTrace, pool_trace
from sglang_bcg_plugin.forecast.driver import DriverShare
from sglang_bcg_plugin.forecast.model import schedule_forecast
from sglang_bcg_plugin.forecast.probe import output_allocs

DATA = Path(__file__).parent / "data" / "forecast" / "h200_fresh_processes.json.gz"
ROWS: list[dict[str, Any]] = json.loads(gzip.decompress(DATA.read_bytes()))["rows"]
#: rows still outside the bound, and why (measured, not yet explained: docs/forecast.md)
KNOWN_MISSES = {
    "qwen2/full/released": "qwen2 with Full loses 33 MiB more than forecast (q/k/v biases): not yet explained",
    "qwen2/full/on": "qwen2 with Full loses 33 MiB more than forecast (q/k/v biases): not yet explained",
    "qwen2/breakable/on": "qwen2 Breakable on lost 26 MiB more than released; the forecast has them equal",
}


def _name(row: dict[str, Any]) -> str:
    return f"{row['model']}/{row['backend']}/{row['mode']}"


def _rebuilt(row: dict[str, Any]) -> int:
    """The configured mode's total, rebuilt from the row's probes with today's model."""
    p = row["probes"]
    sizes, segments = p["sizes"], [tuple(s) for s in p["pool_segments"]]
    large, small = (pool_trace(n, [{"action": a, "addr": addr, "size": size} for a, addr, size in p["probes"][str(n)]],
                               segments) for n in (sizes[0], sizes[-1]))
    d = row["driver"]
    driver = DriverShare(d["graphs"], d["nodes"], d["on_copy_nodes"], d["first_capture"], d["nodes_counted"])
    recorded = row["forecast"]["modes"][row["mode"]]
    modes, *_ = schedule_forecast(
        ScaledTrace.fit(large, small), sizes, outputs=output_allocs(large, [p["largest_output_bytes"]]),
        largest_output_bytes=p["largest_output_bytes"], stream_bytes=recorded["stream_bytes"],
        source="auto", configured_mode=row["mode"], released_keeps="auto", driver=driver,
        probe_left_bytes=recorded["probe_left_bytes"])
    return modes[row["mode"]].total_bytes


@pytest.mark.parametrize("row", ROWS, ids=_name)
def test_forecast_is_within_two_and_a_half_percent_of_what_a_fresh_process_lost(row: dict[str, Any]) -> None:
    if _name(row) in KNOWN_MISSES:
        pytest.xfail(KNOWN_MISSES[_name(row)])
    error = (_rebuilt(row) - row["lost_bytes"]) / row["lost_bytes"]
    assert abs(error) <= 0.025, f"{_name(row)}: {error:+.1%}"


def test_the_rebuilt_forecast_is_the_devices_where_the_model_did_not_change() -> None:
    """The offline rebuild is the device's pipeline: every row but the one the small shared buffer's
    segment fixed (synthetic Full ``on``: a 5.6 MiB buffer takes a 20 MiB segment) is reproduced
    to the byte."""
    changed = {_name(r) for r in ROWS if _rebuilt(r) != r["forecast_bytes"]}
    assert changed == {"synthetic/full/on"}
    row = next(r for r in ROWS if _name(r) == "synthetic/full/on")
    assert _rebuilt(row) - row["forecast_bytes"] == 20 * 2**20 - row["probes"]["largest_output_bytes"]


def test_known_misses_still_miss() -> None:
    """The rows named in KNOWN_MISSES are outside the bound (remove them from it once fixed)."""
    for row in ROWS:
        if _name(row) in KNOWN_MISSES:
            assert abs(_rebuilt(row) - row["lost_bytes"]) / row["lost_bytes"] > 0.025, _name(row)
