"""The forecast inside SGLang (``sglang/forecast_log.py``): the runner's schedule, the KV
cache's bytes per token, the log line, when it is skipped, and the one-probe fit it uses,
checked on the H200 allocator traces (the recording itself needs CUDA: tests/gpu)."""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from sglang_bcg_plugin.forecast import ModeForecast, ScaledTrace, forecast_modes, pool_trace
from sglang_bcg_plugin.forecast.probe import output_allocs
from sglang_bcg_plugin.sglang.doctor import forecast_line
from sglang_bcg_plugin.sglang.forecast_log import (
    SessionForecast,
    format_forecast,
    kv_bytes_per_token,
    schedule_sizes,
)

MIB = 1 << 20
DATA = Path(__file__).parent / "data" / "forecast" / "h200_probes.json.gz"


def test_schedule_from_the_runner() -> None:
    assert schedule_sizes(SimpleNamespace(capture_num_tokens=[4, 16, 8, 16])) == [16, 8, 4]
    assert schedule_sizes(SimpleNamespace(capture_bs=[1, 2, 4])) == [4, 2, 1]
    assert schedule_sizes(SimpleNamespace(capture_num_tokens=[], capture_bs=[2, 1])) == [2, 1]
    assert schedule_sizes(SimpleNamespace(capture_num_tokens=[4, "8"])) is None
    assert schedule_sizes(object()) is None


def test_kv_bytes_per_token_from_the_pool() -> None:
    pool = SimpleNamespace(get_kv_size_bytes=lambda: (3000 * 1024, 3000 * 1024))
    runner = SimpleNamespace(model_runner=SimpleNamespace(token_to_kv_pool=pool, max_total_num_tokens=1000))
    assert kv_bytes_per_token(runner) == 6144
    broken = SimpleNamespace(get_kv_size_bytes=lambda: 1 / 0)
    assert kv_bytes_per_token(SimpleNamespace(model_runner=SimpleNamespace(token_to_kv_pool=broken, max_total_num_tokens=1))) is None
    assert kv_bytes_per_token(SimpleNamespace(model_runner=SimpleNamespace(token_to_kv_pool=pool, max_total_num_tokens=0))) is None
    assert kv_bytes_per_token(object()) is None


def _modes() -> dict[str, ModeForecast]:
    return {"off": ModeForecast("off", 1790 * MIB, 464 * MIB, 1326 * MIB),
            "on": ModeForecast("on", 554 * MIB, 464 * MIB, 90 * MIB),
            "released": ModeForecast("released", 464 * MIB, 464 * MIB, 0)}


def test_the_log_line_says_what_the_mode_frees() -> None:
    line = format_forecast(_modes(), "on", [16384, 4], 30 * 1024)
    assert line.startswith("sglang_bcg: graph memory forecast for 2 sizes up to 16384: 554.0 MiB with --enable-bcg-shared-output=on")
    assert "against off (1,790.0 MiB) it frees 1,236.0 MiB = 42,188 KV tokens" in line
    assert "against released (464.0 MiB) it costs 90.0 MiB" in line and "KV cache 30.0 KiB/token" in line
    assert "KV tokens" not in format_forecast(_modes(), "on", [16384, 4], None)


def test_skipped_when_off_or_without_cuda(caplog: pytest.LogCaptureFixture) -> None:
    runner = SimpleNamespace(capture_num_tokens=[16, 8])
    off = SessionForecast(runner, "on", lambda: None, environ={})  # opt-in: nothing changes until asked
    assert off.skip_reason() == "SGLANG_BCG_FORECAST is not 1"
    assert SessionForecast(runner, "on", lambda: None, environ={"SGLANG_BCG_FORECAST": "0"}).skip_reason() == off.skip_reason()
    if torch.cuda.is_available():  # pragma: no cover - the GPU machine runs tests/gpu
        pytest.skip("the CPU path")
    fc = SessionForecast(runner, "on", lambda: None, environ={"SGLANG_BCG_FORECAST": "1"})
    assert fc.skip_reason() == "no CUDA"
    with caplog.at_level(logging.DEBUG, logger="sglang_bcg_plugin"):
        with fc.first_capture():
            pass
        fc.key_done(16, 1, [])
        with fc.first_capture():  # only the first capture is looked at
            pass
        fc.key_done(8, 1, [])
    assert [r.getMessage() for r in caplog.records] == ["sglang_bcg: no graph memory forecast: no CUDA"]
    assert fc.close(90 * MIB) is None and fc.forecast is None
    none = SessionForecast(object(), "on", lambda: None, environ={})
    assert none.sizes is None


def test_doctor_says_how_to_read_it() -> None:
    on = {"SGLANG_BCG_FORECAST": "1"}
    assert forecast_line("backend", on).startswith("on: after each capture session's first (largest) graph")
    assert forecast_line("backend", {}).startswith("off (SGLANG_BCG_FORECAST=''); SGLANG_BCG_FORECAST=1 logs")
    assert forecast_line("backend", {"SGLANG_BCG_FORECAST": "off"}).startswith("off (SGLANG_BCG_FORECAST='off')")
    assert "runner seam" in forecast_line("runner", on)


@pytest.mark.parametrize("case", ["synthetic/full", "synthetic/breakable", "llama/full", "llama/breakable"])
def test_one_probe_forecast_matches_the_h200(case: str) -> None:
    """What SGLang's first (largest) capture alone gives: within 1 % of every mode's pool."""
    with gzip.open(DATA, "rt") as f:
        data: Any = json.load(f)["cases"][case]
    sizes = data["sizes"]
    segments = [tuple(s) for s in data["pool_segments"]]
    events = [{"action": a, "addr": x, "size": n} for a, x, n in data["probes"][str(sizes[0])]]
    large = pool_trace(sizes[0], events, segments)
    out = data["largest_output_bytes"]
    modes = forecast_modes(ScaledTrace.proportional(large), sizes, outputs=output_allocs(large, [out]),
                           largest_output_bytes=out)
    measured = data["measured"]
    stream = measured["off"]["reserved_bytes"] - measured["off"]["pool_bytes"]  # not in SGLang's pool
    for mode, f in modes.items():
        real = measured[mode]["reserved_bytes"] - stream
        assert abs(f.total_bytes - real) <= 0.01 * real, (case, mode, f.total_bytes, real)


def test_proportional_fit_keeps_small_requests_constant() -> None:
    from sglang_bcg_plugin.errors import ForecastError
    from sglang_bcg_plugin.forecast import KeyTrace

    fitted = ScaledTrace.proportional(KeyTrace(1000, ((0, 1000 * 4096), (0, 512), (1, 0))))
    assert fitted.at(10).ops == ((0, 10 * 4096), (0, 512), (1, 0))
    with pytest.raises(ForecastError, match="positive"):
        ScaledTrace.proportional(KeyTrace(0, ()))


def test_the_log_line_warns_when_the_allocator_runs_expandable_segments(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    assert "caveat" not in format_forecast(_modes(), "on", [16384, 4], None)
    with gzip.open(DATA, "rt") as f:
        data: Any = json.load(f)["cases"]["synthetic/full"]
    sizes, segments = data["sizes"], [tuple(s) for s in data["pool_segments"]]
    events = [{"action": a, "addr": x, "size": n} for a, x, n in data["probes"][str(sizes[0])]]
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    lines = []
    for conf in ("max_split_size_mb:512", "max_split_size_mb:512, expandable_segments:True"):
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
        caplog.clear()
        fc = SessionForecast(SimpleNamespace(capture_num_tokens=sizes), "on", lambda: None,
                             environ={"SGLANG_BCG_FORECAST": "1"})
        with caplog.at_level(logging.INFO, logger="sglang_bcg_plugin"):
            fc._forecast(sizes[0], events, segments, [data["largest_output_bytes"]])
        lines.append(next(r.getMessage() for r in caplog.records if "graph memory forecast" in r.getMessage()))
    assert "expandable_segments" not in lines[0]
    assert "(caveat: the graph pool grows with expandable_segments" in lines[1]


@pytest.mark.parametrize("case", ["synthetic/full", "llama/breakable"])
@pytest.mark.parametrize("mode", ["on", "released"])
def test_off_is_forecast_when_the_session_frees_its_output(case: str, mode: str, caplog: pytest.LogCaptureFixture) -> None:
    """With ``on`` / ``released`` SGLang's first capture frees its output inside the recording
    (copied into the buffer, or its last reference dropped): ``off`` must still be forecast as
    keeping one output per size (it came out equal to ``released``)."""
    with gzip.open(DATA, "rt") as f:
        data: Any = json.load(f)["cases"][case]
    sizes, out = data["sizes"], data["largest_output_bytes"]
    segments = [tuple(s) for s in data["pool_segments"]]
    events = [{"action": a, "addr": x, "size": n} for a, x, n in data["probes"][str(sizes[0])]]
    live: dict[int, int] = {}
    for e in events:
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    (addr,) = [a for a, n in live.items() if n == out]
    freed = [*events, {"action": "free_completed", "addr": addr, "size": out}]  # the policy's free, last
    measured = data["measured"]
    stream = measured["off"]["reserved_bytes"] - measured["off"]["pool_bytes"]
    fc = SessionForecast(SimpleNamespace(capture_num_tokens=sizes), mode, lambda: None, environ={"SGLANG_BCG_FORECAST": "1"})
    with caplog.at_level(logging.INFO, logger="sglang_bcg_plugin"):
        fc._forecast(sizes[0], freed, segments, [out])
    assert fc.forecast is not None
    modes = fc.forecast["modes"]
    for name in ("off", "on", "released"):
        real = measured[name]["reserved_bytes"] - stream
        assert abs(modes[name].total_bytes - real) <= 0.01 * real, (case, mode, name, modes[name].total_bytes, real)
    assert modes["off"].total_bytes - modes["released"].total_bytes > 10 * out  # 74 outputs kept, not none
    kept = SessionForecast(SimpleNamespace(capture_num_tokens=sizes), "off", lambda: None, environ={"SGLANG_BCG_FORECAST": "1"})
    kept._forecast(sizes[0], events, segments, [out])  # the off session's own trace: the same figures
    assert kept.forecast is not None
    assert {k: v.total_bytes for k, v in kept.forecast["modes"].items()} == {k: v.total_bytes for k, v in modes.items()}


def test_outputs_kept_finds_a_freed_output_and_keeps_every_index_valid() -> None:
    from sglang_bcg_plugin.forecast import KeyTrace
    from sglang_bcg_plugin.sglang.forecast_log import outputs_kept

    # allocs: 0 act (freed early), 1 out (freed last, by the policy), 2 act same bytes (freed at return)
    trace = KeyTrace(8, ((0, 100), (0, 800), (1, 0), (0, 800), (0, 16), (1, 3), (1, 1)))
    new, outputs = outputs_kept(trace, [800])
    assert new.ops == ((0, 100), (0, 800), (1, 0), (0, 800), (0, 16), (1, 3)) and outputs == frozenset({1})
    assert new.kept == (1, 4)
    assert outputs_kept(trace, [12345]) == (trace, frozenset({4}))  # nothing matches: every kept alloc, as before
    kept_trace = KeyTrace(8, ((0, 800), (0, 8)))
    assert outputs_kept(kept_trace, [800]) == (kept_trace, frozenset({0}))  # off: kept, the trace unchanged
    assert outputs_kept(kept_trace, [77]) == (kept_trace, frozenset({0, 1}))  # the former fallback


@pytest.mark.parametrize(("family", "warned"), [("qwen2", True), ("gemma", False)])
def test_the_log_line_warns_where_the_pool_depends_on_its_addresses(
        family: str, warned: bool, caplog: pytest.LogCaptureFixture) -> None:
    """From a fresh H200 process's largest capture (tests/data/forecast/h200_fresh_processes.json.gz):
    Qwen2's schedule lands differently with the segments in the other address order (a fresh process
    took 26 MiB more than forecast), Gemma's does not."""
    fresh = Path(__file__).parent / "data" / "forecast" / "h200_fresh_processes.json.gz"
    rows = json.loads(gzip.decompress(fresh.read_bytes()))["rows"]
    p = next(r for r in rows if (r["model"], r["backend"], r["mode"], r.get("schedule", "prefill"),
                                 r.get("pool_reserve", "off")) == (family, "full", "released", "prefill", "off"))["probes"]
    events = [{"action": a, "addr": x, "size": n} for a, x, n in p["probes"][str(p["sizes"][0])]]
    fc = SessionForecast(SimpleNamespace(capture_num_tokens=p["sizes"]), "released", lambda: None,
                         environ={"SGLANG_BCG_FORECAST": "1"})
    with caplog.at_level(logging.INFO, logger="sglang_bcg_plugin"):
        fc._forecast(p["sizes"][0], events, [tuple(s) for s in p["pool_segments"]], [p["largest_output_bytes"]])
    line = next(r.getMessage() for r in caplog.records if "graph memory forecast" in r.getMessage())
    assert ("depends on the addresses cudaMalloc gives its segments" in line) is warned, line
