"""The ``sglang-bcg`` command: bench table, JSON, plot; backends; argument errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sglang_bcg_plugin.bench.model import DecoderConfig, SyntheticDecoder, attention_break, attention_op
from sglang_bcg_plugin.bench.output import CPU_NOTE
from sglang_bcg_plugin.bench.runner import BenchRow
from sglang_bcg_plugin.bench.sizes import prefill_capture_sizes
from sglang_bcg_plugin.cli import main


def test_prefill_sizes_match_sglang_schedule() -> None:
    assert len(prefill_capture_sizes(8192)) == 58
    assert len(prefill_capture_sizes(16384)) == 74
    assert prefill_capture_sizes(40) == [4, 8, 12, 16, 20, 24, 28, 32]
    with pytest.raises(ValueError, match="max_tokens"):
        prefill_capture_sizes(3)


def test_break_and_op_compute_the_same_attention() -> None:
    cfg = DecoderConfig(32, 1, 4, 2, 64, torch.float32, "cpu")
    x = torch.randn(12, 32)
    a = SyntheticDecoder(cfg, attention=attention_break)(x)
    b = SyntheticDecoder(cfg, attention=attention_op)(x)
    torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="multiple of heads"):
        DecoderConfig(30, 1, 4, 2, 64, torch.float32, "cpu")
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        DecoderConfig(32, 1, 4, 3, 64, torch.float32, "cpu")


def test_bench_writes_table_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "--backends", "breakable,full", "--max-tokens", "64", "--hidden", "32", "--layers", "1",
               "--repeats", "2", "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "breakable: on saves " in out and "of resident output against off" in out
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["device"] == "cpu" and doc["config"]["max_tokens"] == 64 and doc["config"]["num_sizes"] == 10
    rows = {(r["backend"], r["variant"]): r for r in doc["rows"]}
    assert set(rows) == {(b, v) for b in ("breakable", "full") for v in ("off", "on", "released")}
    assert {v: r["output_mode"] for (_, v), r in rows.items()} == {"off": "off", "on": "on", "released": "released"}
    keys = {"backend", "output_mode", "num_sizes", "max_tokens", "resident_output_bytes", "logical_output_bytes",
            "graph_memory_bytes", "capture_s", "replay_ms", "max_abs_err"}
    for row in doc["rows"]:
        assert keys <= set(row)
        assert row["graph_memory_bytes"] is None and row["max_abs_err"] == 0.0 and row["fallbacks"] == 0
    for b in ("breakable", "full"):
        on, off = rows[(b, "on")], rows[(b, "off")]
        assert on["logical_output_bytes"] == off["logical_output_bytes"] == off["resident_output_bytes"]
        assert on["resident_output_bytes"] == 64 * 32 * 4
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"
    import datetime

    import sglang_bcg_plugin

    assert doc["package_version"] == sglang_bcg_plugin.__version__ and doc["torch_version"] == torch.__version__
    stamp = datetime.datetime.fromisoformat(doc["timestamp"])
    assert stamp.utcoffset() == datetime.timedelta(0)
    assert doc["timings_meaningful"] is False
    for row in doc["rows"]:
        sizes = [r["size"] for r in row["per_size"]]
        assert sizes == sorted(prefill_capture_sizes(64), reverse=True)
        assert sum(r["resident_output_bytes"] for r in row["per_size"]) == row["resident_output_bytes"]
        assert sum(r["logical_output_bytes"] for r in row["per_size"]) == row["logical_output_bytes"]
        assert all(r["capture_s"] > 0 and r["graph_memory_bytes"] is None for r in row["per_size"])
        assert row["replay_ms_min"] <= row["replay_ms"] <= row["replay_ms_max"]
    assert CPU_NOTE in out and "n/m" not in out


def test_bench_floor_variant(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "--backends", "full", "--variants", "floor", "--max-tokens", "16", "--hidden", "16",
               "--layers", "1", "--repeats", "1", "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    row = json.loads((tmp_path / "bench.json").read_text())["rows"][0]
    assert row["variant"] == "floor" and row["resident_output_bytes"] == 0 and row["max_abs_err"] is None
    capsys.readouterr()


@pytest.mark.parametrize(
    ("argv", "msg"),
    [
        (["bench", "--backends", "nope"], "unknown backends ['nope']"),
        (["bench", "--variants", "sideways"], "unknown variants ['sideways']"),
    ],
)
def test_bench_argument_errors(argv: list[str], msg: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert msg in capsys.readouterr().err


def test_bench_cuda_requested_without_cuda(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "--device", "cuda"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_bad_positive_int(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("0", "x"):
        with pytest.raises(SystemExit):
            main(["bench", "--max-tokens", bad])
    assert "positive integer" in capsys.readouterr().err


def test_backends_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "breakable\tsglang_bcg_plugin.backends.breakable" in out and "piecewise" in out


def test_python_dash_m_entry() -> None:
    proc = subprocess.run([sys.executable, "-m", "sglang_bcg_plugin", "backends"], capture_output=True, text=True, check=False)
    assert proc.returncode == 0 and "full" in proc.stdout


def test_bench_without_tqdm_and_matplotlib(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plain ``pip install`` (no [bench] extra): a plain progress line, no plot, one line why."""
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    rc = main(["bench", "--backends", "full", "--variants", "on", "--max-tokens", "8", "--hidden", "16",
               "--layers", "1", "--repeats", "1", "--out", str(tmp_path)])
    assert rc == 0
    err = capsys.readouterr().err
    assert "full/on: 2/2 sizes" in err
    assert "plot skipped: matplotlib is not installed; for bench.png install the [bench] extra" in err
    assert (tmp_path / "bench.json").exists() and not (tmp_path / "bench.png").exists()
    assert f"wrote {tmp_path / 'bench.json'}\n" in err


def test_line_progress_hidden() -> None:
    import io

    from sglang_bcg_plugin.bench.runner import LineProgress

    stream = io.StringIO()
    bar = LineProgress(3, "x", stream, enabled=False)
    bar.update()
    bar.close()
    assert stream.getvalue() == "" and bar.n == 1


def test_valid_env_value_is_noted(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_ENABLE_BCG_SHARED_OUTPUT", "1")
    assert main(["bench", "--backends", "full", "--variants", "off", "--max-tokens", "4", "--hidden", "16",
                 "--layers", "1", "--repeats", "1", "--no-progress"]) == 0
    out = capsys.readouterr()
    assert "note: SGLANG_ENABLE_BCG_SHARED_OUTPUT does not apply: bench sets sharing per --variants (off)" in out.err
    assert "full" in out.out


def test_plot_labels_keep_two_significant_digits() -> None:
    from sglang_bcg_plugin.bench.output import sig2

    got = [sig2(v) for v in (0.125, 1.11, 90.4, 1634.0, 99.7, 0.0996, 0.0, 12345.0)]
    assert got == ["0.12", "1.1", "90", "1600", "100", "0.10", "0", "12000"]


def test_released_is_measured_on_every_backend_in_the_same_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--variants ...,released``: every backend gets its ``released`` row, beside off and on,
    and the plot has one group per backend with every row's bar."""
    from sglang_bcg_plugin.bench.output import plot_groups

    rc = main(["bench", "--backends", "breakable,full,piecewise", "--variants", "off,on,released", "--max-tokens", "16",
               "--hidden", "16", "--layers", "1", "--repeats", "1", "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    assert "released" in capsys.readouterr().out  # the table has the rows
    doc = json.loads((tmp_path / "bench.json").read_text())
    rows = {(r["backend"], r["variant"]): r for r in doc["rows"]}
    assert set(rows) == {(b, v) for b in ("breakable", "full", "piecewise") for v in ("off", "on", "released")}
    for b in ("breakable", "full", "piecewise"):
        released = rows[(b, "released")]
        assert released["output_mode"] == "released" and released["max_abs_err"] == 0.0 and released["fallbacks"] == 0
        # the eager engine has no graph pool: released outputs stay owned, as with off
        assert released["resident_output_bytes"] == rows[(b, "off")]["resident_output_bytes"]
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"
    groups = plot_groups([BenchRow.from_dict(r) for r in doc["rows"]], graph_memory=False)
    assert [(g.backend, g.reference, [b.variant for b in g.bars]) for g in groups] == [
        (b, False, ["off", "on", "released"]) for b in ("breakable", "full", "piecewise")
    ]


def _row(backend: str, variant: str, graph_mib: int | None, replay: float) -> BenchRow:
    resident = 0 if backend == "graph-trees" else 2 * 2**20
    graph = None if graph_mib is None else graph_mib * 2**20
    return BenchRow(backend, variant, "off", 2, 8, resident, 4 * 2**20, graph, 1.0, replay, 0.0, 0,
                    replay_ms_min=replay - 0.5, replay_ms_max=replay + 1.0)


@pytest.mark.parametrize("graph_memory", [True, False])
def test_plot_gives_graph_trees_its_own_group_with_the_same_metrics(graph_memory: bool, tmp_path: Path) -> None:
    """Graph Trees is its own group, after ours wherever --backends lists it, with the same
    metric keys; a metric that does not apply (resident output, CPU) is ``None``, not 0."""
    from sglang_bcg_plugin.bench.output import (
        GRAPH_TREES_CPU_LABEL, GRAPH_TREES_LABEL, PLOT_METRICS, plot_groups, write_plot,
    )

    def mib(n: int) -> int | None:
        return n if graph_memory else None

    rows = [
        _row("graph-trees", "reference", mib(816), 32.0),
        _row("breakable", "off", mib(2000), 33.0), _row("breakable", "released", mib(620), 32.5),
        _row("full", "off", mib(1700), 31.0), _row("full", "released", mib(710), 31.5),
    ]
    groups = plot_groups(rows, graph_memory=graph_memory)
    assert [(g.backend, g.reference) for g in groups] == [("breakable", False), ("full", False), ("graph-trees", True)]
    trees = groups[-1]
    assert "Graph Trees" in trees.tick and [b.variant for b in trees.bars] == ["reference"]
    for g in groups:
        for bar in g.bars:
            assert tuple(bar.values) == PLOT_METRICS
    (ref,) = trees.bars
    assert ref.values["replay_ms"] == 32.0 and ref.replay_spread == (0.5, 1.0)
    if graph_memory:
        assert ref.values["memory_mib"] == 816 and ref.label == GRAPH_TREES_LABEL
        assert [b.values["memory_mib"] for b in groups[0].bars] == [2000, 620]
    else:
        assert ref.values["memory_mib"] is None and ref.label == GRAPH_TREES_CPU_LABEL  # left out, not 0
        assert [b.values["memory_mib"] for b in groups[0].bars] == [2.0, 2.0]
    assert [b.label for b in groups[0].bars] == ["sharing off", "outputs released (zero-copy)"]
    config = {"max_tokens": 8, "layers": 1, "hidden": 16, "dtype": "float32", "num_sizes": 2}
    assert write_plot(tmp_path / "bench.png", "test", config, rows, timings_meaningful=graph_memory)
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_groups_without_graph_trees_or_rows() -> None:
    from sglang_bcg_plugin.bench.output import plot_groups

    assert plot_groups([], graph_memory=False) == []
    only = plot_groups([_row("graph-trees", "reference", 816, 32.0)], graph_memory=True)
    assert [(g.backend, g.reference) for g in only] == [("graph-trees", True)]


def test_gpu_table_prints_savings_of_graph_memory_and_the_replay_change() -> None:
    """On CUDA a row is compared with ``off`` by graph memory (MiB and %) and replay time (%); no CPU note."""
    from sglang_bcg_plugin.bench.output import CPU_NOTE, format_table
    from sglang_bcg_plugin.bench.runner import BenchRow

    def row(variant: str, mode: str, graph_mib: int, replay: float) -> BenchRow:
        return BenchRow("full", variant, mode, 2, 8, 100, 200, graph_mib << 20, 1.0, replay, 0.0, 0)

    text = format_table([row("off", "off", 1790, 2.0), row("on", "on", 554, 1.0), row("guard", "on", 1800, 2.5),
                         row("released", "released", 1790, 2.0)])
    minus = "\N{MINUS SIGN}"
    assert f"full: on saves 1,236.0 MiB ({minus}69 %) of graph memory against off; replay {minus}50.0 %" in text
    assert "full: guard costs 10.0 MiB (+0.6 %) more graph memory than off; replay +25.0 %" in text
    assert "full: released holds as much graph memory as off (1,790.0 MiB); replay 0.0 %" in text
    assert CPU_NOTE not in text and "CPU" not in text


def test_bench_llama_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--model llama``: transformers' LlamaModel with random weights, every backend shares."""
    pytest.importorskip("transformers")
    rc = main(["bench", "--model", "llama", "--max-tokens", "16", "--hidden", "32", "--layers", "1", "--heads", "2",
               "--kv-heads", "1", "--head-dim", "16", "--repeats", "1", "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["config"]["model"] == "llama" and doc["config"]["head_dim"] == 16
    for row in doc["rows"]:
        assert row["model"] == "llama" and row["max_abs_err"] == 0.0 and row["fallbacks"] == 0
        if row["variant"] == "on":
            assert row["resident_output_bytes"] == 16 * 32 * 4  # one [1, 16, 32] output
    assert any(r["backend"] == "breakable" and r["bridge_bytes"] == 0 for r in doc["rows"])  # eager engine: no bridges
    capsys.readouterr()


def test_bench_head_dim_is_for_llama_only(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--head-dim", "16"]) == 2
    assert "--head-dim applies to --model llama only" in capsys.readouterr().err


def test_size_stats_match_the_schedule_without_building_it() -> None:
    from sglang_bcg_plugin.bench.sizes import capture_size_stats

    for m in [*range(4, 600), 1023, 1024, 1025, 1279, 1280, 4095, 4096, 4097, 4607, 4608, 4609, 8192, 16384, 20000]:
        sizes = prefill_capture_sizes(m)
        assert capture_size_stats(m) == (len(sizes), sum(sizes), max(sizes)), m
    big = capture_size_stats(10**22)  # constant time: the list would not fit in any memory
    assert big.largest == 4608 + (10**22 - 4608) // 512 * 512 and big.num > 10**19
    with pytest.raises(ValueError, match="max_tokens"):
        capture_size_stats(True)


def test_split_attention_fake_has_the_value_head_size() -> None:
    """The fake (dynamo's shapes) agrees with the op when query and value head sizes differ."""
    pytest.importorskip("transformers")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from sglang_bcg_plugin.bench.workload import split_attention_op

    q, k, v = torch.randn(1, 4, 6, 2), torch.randn(1, 2, 6, 2), torch.randn(1, 2, 6, 3)
    real = split_attention_op(q, k, v, 0.5)
    with FakeTensorMode() as mode:
        fake = split_attention_op(mode.from_tensor(q), mode.from_tensor(k), mode.from_tensor(v), 0.5)
    assert tuple(fake.shape) == tuple(real.shape) == (1, 6, 4, 3)


def test_llama_config_rejection_is_a_usage_error() -> None:
    pytest.importorskip("transformers")
    from sglang_bcg_plugin.bench.usage import UsageError
    from sglang_bcg_plugin.bench.workload import ModelShape, llama_config

    def shape(hidden: int, heads: int, head_dim: int) -> ModelShape:
        return ModelShape(hidden, 1, heads, 1, head_dim, 32, torch.float32, "cpu")

    assert llama_config(shape(32, 2, 16), 8, 64).head_dim == 16
    with pytest.raises(UsageError, match=r"transformers' LlamaConfig rejects --hidden 63 --heads 4 .*\(The hidden size \(63\) is not a multiple"):
        llama_config(shape(63, 4, 8), 8, 64)


def test_json_ratios_follow_the_table() -> None:
    """On CPU the table prints no timing comparison and bench.json holds null for the timing ratios;
    the savings it prints are bench.json's ``savings``."""
    from sglang_bcg_plugin.bench.output import TIMING_RATIOS, format_table, ratios, savings
    from sglang_bcg_plugin.bench.runner import BenchRow

    rows = [BenchRow("full", "off", "off", 2, 8, 3 << 20, 3 << 20, None, 1.0, 2.0, 0.0, 0),
            BenchRow("full", "on", "on", 2, 8, 1 << 20, 3 << 20, None, 0.5, 9.0, 0.0, 0)]
    cpu = ratios(rows, timings_meaningful=False)["full"]
    assert all(cpu[k] is None for k in TIMING_RATIOS) and cpu["resident_on_over_off"] == pytest.approx(1 / 3)
    assert ratios(rows)["full"]["replay_on_over_off"] == 4.5
    text = format_table(rows, timings_meaningful=False)
    assert "full: on saves 2.0 MiB (\N{MINUS SIGN}67 %) of resident output against off\n" in text
    assert "replay" not in text.split("full: on saves")[1].splitlines()[0] and "n/m" not in text
    (saving,) = savings(rows, timings_meaningful=False)
    assert saving.to_dict() == {"backend": "full", "variant": "on", "metric": "resident_output_bytes",
                                "off_bytes": 3 << 20, "held_bytes": 1 << 20, "replay_change": None, "against": "off",
                                "saved_bytes": 2 << 20, "change": pytest.approx(-2 / 3)}


def test_per_size_capture_seconds_leave_compile_time_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A row's and its sizes' ``capture_s`` both leave compile time out; ``compile_s`` adds up."""
    rc = main(["bench", "--backends", "piecewise,full", "--variants", "on", "--max-tokens", "8", "--hidden", "16",
               "--layers", "1", "--repeats", "1", "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    capsys.readouterr()
    doc = json.loads((tmp_path / "bench.json").read_text())
    rows = {r["backend"]: r for r in doc["rows"]}
    pw, full = rows["piecewise"], rows["full"]
    assert pw["compile_s"] > 0 and pw["compile_s"] == pytest.approx(sum(s["compile_s"] for s in pw["per_size"]))
    assert pw["per_size"][0]["compile_s"] > 0  # the first, largest capture compiles
    for row in (pw, full):
        assert sum(s["capture_s"] for s in row["per_size"]) <= row["capture_s"]
        assert all(s["capture_s"] > 0 for s in row["per_size"])
    assert full["compile_s"] is None and all(s["compile_s"] is None for s in full["per_size"])
    assert doc["ratios"] == {}  # one variant: no on/off ratio
    assert doc["cold"] is None  # off CUDA: no whole-schedule warm-up, no forecast


def test_the_cold_row_is_the_first_schedules_loss_against_the_forecast_with_the_driver() -> None:
    """``cold_summary``: the session's drop plus what the forecast left lost, against the
    configured mode's total (the driver's share in it); nothing without a forecast or a measure."""
    from sglang_bcg_plugin.bench.runner import cold_summary

    row = BenchRow("breakable", "released", "released", 50, 4096, 0, 0, 400 << 20, 1.0, 1.0, 0.0, 0)
    assert cold_summary(None) is None and cold_summary(row) is None  # no forecast
    row.forecast = {"mode": "released", "lasting_bytes": 100 << 20,
                    "modes": {"released": {"total_bytes": 490 << 20}, "off": {"total_bytes": 1 << 30}}}
    cold = cold_summary(row)
    assert cold is not None
    assert (cold["lost_bytes"], cold["forecast_bytes"]) == (500 << 20, 490 << 20)
    assert cold["forecast_error"] == pytest.approx(-0.02) and cold["backend"] == "breakable"
    row.graph_memory_bytes = None  # off CUDA
    assert cold_summary(row) is None


def test_tensor_parallel_shards_compute_the_whole_decoder() -> None:
    """Two ranks (two threads, an all-reduce that sums their partials) give the unsplit model's
    output, with a head size that is not hidden / heads; shapes that do not split are refused."""
    import threading

    cfg = DecoderConfig(32, 2, 4, 2, 48, torch.float64, "cpu", head_dim=12)  # q cols 48 != hidden 32
    x = torch.randn(6, 32, dtype=torch.float64)
    whole = SyntheticDecoder(cfg, attention=attention_op)(x)
    barrier, partials = threading.Barrier(2), [[], []]
    outs: list[torch.Tensor | None] = [None, None]

    def rank(r: int) -> None:
        def reduce(t: torch.Tensor) -> torch.Tensor:
            partials[r].append(t)
            barrier.wait()
            total = partials[0][-1] + partials[1][-1]
            barrier.wait()
            return total

        outs[r] = SyntheticDecoder(cfg, attention=attention_op, rank=r, world=2, reduce=reduce)(x)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(partials[0]) == len(partials[1]) == 2 * cfg.layers
    for out in outs:
        torch.testing.assert_close(out, whole)
    with pytest.raises(ValueError, match="kv_heads 2 does not split over 4 ranks"):
        SyntheticDecoder(cfg, attention=attention_op, rank=0, world=4)


_PEAK_SCRIPT = """
import json, re, sys, torch
from sglang_bcg_plugin.bench.runner import run_variant
from sglang_bcg_plugin.bench.sizes import prefill_capture_sizes
from sglang_bcg_plugin.bench.workload import WORKLOADS, ModelShape
backend, model, hidden, layers, max_tokens = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
wl = WORKLOADS[model](ModelShape(hidden, layers, 4, 2, 16 if model == "llama" else hidden // 4, hidden, torch.float32, "cpu"))
run_variant(backend, "off", wl, prefill_capture_sizes(4), repeats=1, progress=False, forecast=False)
with open("/proc/self/statm") as f:
    base = int(f.read().split()[1]) * 4096
run_variant(backend, "off", wl, prefill_capture_sizes(max_tokens), repeats=1, progress=False, forecast=False)
with open("/proc/self/status") as f:  # this process's own peak: ru_maxrss keeps the forking parent's
    peak = int(re.search(r"VmHWM:\\s+(\\d+) kB", f.read()).group(1)) * 1024
print(json.dumps(peak - base))
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads the resident set from /proc")
@pytest.mark.parametrize(("backend", "model"), [("breakable", "synthetic"), ("breakable", "llama"), ("piecewise", "synthetic")])
def test_fits_in_memory_estimate_is_a_lower_bound_of_the_cpu_peak(backend: str, model: str) -> None:
    """The "fits in memory" estimate of a CPU Breakable / Piecewise run: at most its measured peak
    (a lower bound), and more than half of it (it was an eighth: the op tape keeps every size's
    activations). A fresh process per run, its peak RSS (``VmHWM``) over its RSS before the run."""
    if model == "llama":
        pytest.importorskip("transformers")
    from sglang_bcg_plugin.bench import budget
    from sglang_bcg_plugin.bench.workload import ModelShape

    hidden, layers, max_tokens = 128, 2, 512
    root = str(Path(__file__).resolve().parents[1])
    proc = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, backend, model, str(hidden), str(layers), str(max_tokens)],
                          capture_output=True, text=True, timeout=300, cwd=root, check=False)
    assert proc.returncode == 0, proc.stderr
    peak = json.loads(proc.stdout.strip().splitlines()[-1])
    shape = ModelShape(hidden, layers, 4, 2, 16 if model == "llama" else hidden // 4, hidden, torch.float32, "cpu")
    est = budget.estimate_bytes(shape, prefill_capture_sizes(max_tokens), ["off"], backends=[backend], workload=model)
    assert 0.5 * peak < est <= peak, (est, peak)


def test_warm_up_runs_the_whole_schedule_first_and_forecasts_only_the_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA with the schedule: every backend captures it once (released), the first after a
    forecast (the process's first schedule, returned as the cold row); then the small cycles. On
    CPU, or without the schedule: only the small cycles, no cold row."""
    from types import SimpleNamespace

    from sglang_bcg_plugin.bench import runner

    calls: list[tuple[str, str, int, bool]] = []

    def run_variant(name: str, variant: str, workload: object, sizes: list[int], **kw: object) -> object:
        calls.append((name, variant, len(sizes), bool(kw.get("forecast", True))))
        return SimpleNamespace(backend=name)

    monkeypatch.setattr(runner, "run_variant", run_variant)
    cuda = SimpleNamespace(shape=SimpleNamespace(device="cuda:0"))
    cold = runner.warm_up(cuda, ["breakable", "full"], [16, 8, 4])  # type: ignore[arg-type]
    assert cold is not None and cold.backend == "breakable"
    assert calls == [("breakable", "released", 3, True), ("full", "released", 3, False),
                     ("breakable", "off", 1, False), ("full", "off", 1, False)]
    calls.clear()
    cpu = SimpleNamespace(shape=SimpleNamespace(device="cpu"))
    assert runner.warm_up(cpu, ["full"], [16, 8, 4]) is None  # type: ignore[arg-type]
    assert runner.warm_up(cuda, ["full"]) is None  # type: ignore[arg-type]
    assert calls == [("full", "off", 1, False), ("full", "off", 1, False)]


# -- the table a terminal shows, and what the CPU cannot measure -----------------------------------
def _widest(text: str) -> int:
    return max(len(line) for line in text.splitlines())


def _saving_line(backend: str, variant: str, off: dict[str, object], row: dict[str, object]) -> str:
    """The line the table should print for ``row`` against ``off`` on CPU, from bench.json's numbers."""
    before, after = int(off["resident_output_bytes"]), int(row["resident_output_bytes"])  # type: ignore[call-overload]
    if before == after:
        return f"{backend}: {variant} holds as much resident output as off ({after / 2**20:,.1f} MiB)"
    pct = abs(after - before) / before * 100
    sign = "\N{MINUS SIGN}" if after < before else "+"
    verb = "saves" if after < before else "costs"
    tail = "of resident output against off" if after < before else "more resident output than off"
    return f"{backend}: {variant} {verb} {abs(before - after) / 2**20:,.1f} MiB ({sign}{pct:.0f} %) {tail}"


@pytest.mark.slow
def test_the_default_cpu_run_fits_a_terminal_and_says_what_the_cpu_cannot_measure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``sglang-bcg bench --out out``, the README's main job, as it is: every backend in off, on and
    released; the table at most 120 columns; savings in MiB and % as bench.json's rows give them;
    the CPU note instead of empty graph-memory and forecast columns."""
    assert main(["bench", "--out", str(tmp_path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["config"]["variants"] == ["off", "on", "released"] and doc["config"]["num_sizes"] == 22
    assert _widest(out) <= 120
    assert CPU_NOTE in out and "docs/benchmarks.md" in out
    head = out.splitlines()[0].split()
    assert "resident" in head and "graph" not in head and "forecast" not in head and "n/m" not in out
    rows = {(r["backend"], r["variant"]): r for r in doc["rows"]}
    assert set(rows) == {(b, v) for b in ("breakable", "full", "piecewise") for v in ("off", "on", "released")}
    for backend in ("breakable", "full", "piecewise"):
        off = rows[(backend, "off")]
        for variant in ("on", "released"):
            assert _saving_line(backend, variant, off, rows[(backend, variant)]) in out.splitlines()
    assert [(s["backend"], s["variant"]) for s in doc["savings"]] == [
        (b, v) for b in ("breakable", "full", "piecewise") for v in ("on", "released")]
    table = out.splitlines()
    assert sum(line.split()[1:2] == ["released*"] for line in table) == 3  # released ran as off here
    (footnote,) = [line for line in table if line.startswith("released*: ")]
    assert footnote.startswith("released*: ran as off (CUDA-only: released outputs are aliases of CUDA graph-pool")
    assert all(rows[(b, "released")]["ran_as"] == "off" for b in ("breakable", "full", "piecewise"))


def test_a_run_with_many_variants_fits_a_terminal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Six variants and the Graph Trees row on CPU: every printed line at most 120 columns (``guard``
    is left out: on CPU torch it warns that it cannot poison, and warnings are errors here)."""
    variants = "off,on,floor,adopt,reserve,released"
    assert main(["bench", "--backends", "breakable,full,graph-trees", "--variants", variants, "--max-tokens", "16",
                 "--hidden", "16", "--layers", "1", "--repeats", "1", "--out", str(tmp_path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert _widest(out) <= 120
    table = out.splitlines()
    assert sum(line.startswith(("breakable ", "full ")) for line in table) == 12
    assert "graph-trees: resident n/a" in out and "full: floor saves " in out and CPU_NOTE in out


def _gpu_rows(backends: list[str], variants: list[str]) -> list[BenchRow]:
    """Rows as a CUDA run writes them, with the widest figures of docs/benchmarks.md's tables."""
    rows = []
    for b in backends:
        for i, v in enumerate(["reference"] if b == "graph-trees" else variants):
            rows.append(BenchRow(b, v, "on", 74, 16384, 1705144320 - i, 1705144320, (2222 << 20) - i, 12.34, 32.523,
                                 0.0859, 0, bridge_bytes=128 << 20, compile_s=67.42, forecast_bytes=(2210 << 20) - i,
                                 forecast_error=0.009))
    return rows


@pytest.mark.parametrize("backends", [["breakable", "full", "piecewise", "graph-trees"],
                                      ["a-plugin-backend-with-a-very-long-name-indeed", "full"]])
def test_every_variant_with_cuda_figures_fits_120_columns(backends: list[str]) -> None:
    """With every variant and every column a CUDA run fills, the table drops the least needed
    columns (and says which: bench.json has them), then cuts names, to fit 120 columns."""
    from sglang_bcg_plugin.bench.output import DROP_ORDER, format_table
    from sglang_bcg_plugin.bench.runner import VARIANTS

    rows = _gpu_rows(backends, list(VARIANTS))
    text = format_table(rows)
    assert _widest(text) <= 120
    head = text.splitlines()[0].split()
    assert head[:4] == ["backend", "variant", "graph", "forecast"] and "resident" in head and "replay" in head
    (left_out,) = [line for line in text.splitlines() if line.startswith("left out to fit 120 columns")]
    assert "logical MiB" in left_out and all(name in DROP_ORDER for name in ("logical", "compile"))
    assert _widest(format_table(rows, width=200)) > 120  # the same rows, a wider terminal: nothing left out
    assert "left out" not in format_table(rows, width=200)
    narrow = format_table(rows, width=80)
    assert _widest(narrow.split("\n" + "left out")[0]) <= 80


def test_cpu_defaults_include_released() -> None:
    from sglang_bcg_plugin.bench import config
    from sglang_bcg_plugin.cli import _parser
    from sglang_bcg_plugin.registry import available_backends

    cfg = config.build_config(_parser().parse_args(["bench", "--device", "cpu"]), available_backends())
    assert cfg.variants == ["off", "on", "released"] and not cfg.gpu


def test_an_old_bench_json_with_share_output_is_read() -> None:
    """docs/img/bench-h200.json was written when the mode was ``share_output`` (a bool): its rows read
    as rows with ``output_mode``; so do the str() forms a GPU driver wrote and ``"released"``."""
    from sglang_bcg_plugin.bench.output import format_table

    old = json.loads((Path(__file__).resolve().parents[1] / "docs" / "img" / "bench-h200.json").read_text())
    assert all("share_output" in r and "output_mode" not in r for r in old["rows"])
    rows = [BenchRow.from_dict(r) for r in old["rows"]]
    modes = {(r.backend, r.variant): r.output_mode for r in rows}
    assert modes[("breakable", "off")] == "off" and modes[("full", "on")] == "on"
    assert modes[("piecewise", "guard")] == "on"
    assert modes[("full", "floor")] == "off"  # floor set no mode: nothing is kept
    assert rows[0].graph_memory_bytes == old["rows"][0]["graph_memory_bytes"] and rows[0].per_size == []
    assert _widest(format_table(rows)) <= 120 and "breakable: on saves " in format_table(rows)
    new = rows[0].to_dict()
    assert "share_output" not in new and BenchRow.from_dict(new) == rows[0]
    base = {k: v for k, v in old["rows"][0].items() if k != "share_output"}
    pairs = ((True, "on"), ("True", "on"), ("False", "off"), ("released", "released"), ("RELEASED", "released"))
    for share, mode in pairs:
        assert BenchRow.from_dict({**base, "share_output": share}).output_mode == mode
    assert BenchRow.from_dict({**base, "output_mode": "On"}).output_mode == "on"
    with pytest.raises(ValueError, match="sometimes"):
        BenchRow.from_dict({**base, "output_mode": "sometimes"})


def test_the_cpu_plot_leaves_replay_timing_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU bench.png has the memory panel alone and says why (eager CPU time is not CUDA-graph
    replay); with meaningful timings it has both panels."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from sglang_bcg_plugin.bench.output import CPU_CAPTION, write_plot

    saved: list[tuple[list[str], list[str]]] = []
    original = Figure.savefig

    def savefig(fig: Figure, *args: object, **kwargs: object) -> None:
        saved.append(([ax.get_title() for ax in fig.axes], [t.get_text() for t in fig.texts]))
        original(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    config = {"max_tokens": 8, "layers": 1, "hidden": 16, "dtype": "float32", "num_sizes": 2}
    rows = [_row("breakable", "off", None, 30.0), _row("breakable", "on", None, 75.0)]
    assert write_plot(tmp_path / "cpu.png", "cpu", config, rows, timings_meaningful=False)
    assert write_plot(tmp_path / "gpu.png", "H200", config, rows, timings_meaningful=True)
    (cpu_titles, cpu_texts), (gpu_titles, gpu_texts) = saved
    assert len(cpu_titles) == 1 and "replay" not in " ".join(cpu_titles).lower()
    assert cpu_texts[1:] == CPU_CAPTION.splitlines() and "docs/benchmarks.md" in CPU_CAPTION  # [0]: the title
    assert len(gpu_titles) == 2 and "Replay" in gpu_titles[1] and len(gpu_texts) == 1


def test_the_minus_sign_prints_where_the_terminal_has_none() -> None:
    from sglang_bcg_plugin.bench.output import percent, printable

    text = f"full: on saves 1.0 MiB ({percent(-0.35)}) of resident output against off; name…"
    assert "\N{MINUS SIGN}35 %" in text
    assert printable(text, "utf-8") == text and printable(text, None) == text and printable(text, "no-such") == text
    assert printable(text, "latin-1") == "full: on saves 1.0 MiB (-35 %) of resident output against off; name..."
    assert printable("\N{SNOWMAN}", "ascii") == "?"
    assert [percent(f) for f in (0.0, 0.004, -0.0004, 0.35, -0.0123)] == [
        "0.0 %", "+0.4 %", "0.0 %", "+35 %", "\N{MINUS SIGN}1 %"]


def test_a_variant_the_eager_engine_cannot_run_says_what_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every variant needing a graph pool (``*packed*``, ``*expandable*``, ``*released``) names, on the
    eager engine, the variant it runs as (or its meaning, where none has it) and why; ``guard`` only
    where this torch cannot poison storages; the rest run as themselves."""
    from sglang_bcg_plugin.bench.runner import VARIANTS, eager_note, eager_stand_in

    monkeypatch.setattr(torch._C, "_set_storage_access_error_msg", lambda t, m: None, raising=False)
    ran = {v: eager_stand_in(v) for v in VARIANTS}
    assert {v for v, r in ran.items() if r is None} == {"off", "on", "floor", "guard", "adopt", "reserve", "inductor"}
    assert {v: r[0] for v, r in ran.items() if r is not None} == {
        "released": "off", "packed": "on", "packed-released": "off", "inductor-packed": "inductor",
        "expandable-released": "off", "inductor-expandable": "inductor",
        "inductor-released": "'sharing off, Inductor first'", "inductor-packed-released": "'sharing off, Inductor first'",
        "inductor-expandable-released": "'sharing off, Inductor first'",
    }
    assert all(r[1].startswith("CUDA-only: ") for r in ran.values() if r is not None)
    assert "pool_segments='expandable'" in ran["inductor-expandable"][1] and "pool_reserve" not in ran["inductor-expandable"][1]
    monkeypatch.delattr(torch._C, "_set_storage_access_error_msg")
    assert eager_stand_in("guard") == ("on", "the stale-output guard poisons storages, which this torch build cannot; "
                                                "a CUDA build can")
    assert eager_note("on") is None and eager_note("packed-released") == (
        "note: --variants packed-released runs as off here (CUDA-only: pool_reserve='auto' starts a CUDA graph pool as one "
        "block; released outputs are aliases of CUDA graph-pool memory, and the eager engine has no graph pool): its rows "
        "measure that, under the name packed-released")


def test_bench_on_cpu_says_which_variants_ran_as_another(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A CUDA-only variant on CPU: a note before the run, its progress line, a starred table row with
    a footnote, and ``ran_as``/``ran_as_reason`` in ``bench.json``; its numbers are those of what ran."""
    rc = main(["bench", "--backends", "full", "--variants", "off,on,packed,expandable-released", "--max-tokens", "16",
               "--hidden", "16", "--layers", "1", "--repeats", "1", "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    out = capsys.readouterr()
    assert "note: --variants packed runs as on here (CUDA-only: pool_reserve='auto'" in out.err
    assert "note: --variants expandable-released runs as off here (CUDA-only: pool_segments='expandable'" in out.err
    assert "full/packed done in" in out.err and ": ran as on (CUDA-only" in out.err
    table = out.out.splitlines()
    assert any(" packed* " in line for line in table) and any(" on " in line and "*" not in line for line in table)
    assert any(line.startswith("expandable-released*: ran as off (CUDA-only") for line in table)
    rows = {r["variant"]: r for r in json.loads((tmp_path / "bench.json").read_text())["rows"]}
    assert rows["off"]["ran_as"] is None and rows["on"]["ran_as"] is None
    assert rows["packed"]["ran_as"] == "on" and "pool_reserve='auto'" in rows["packed"]["ran_as_reason"]
    assert rows["expandable-released"]["ran_as"] == "off"
    assert rows["packed"]["resident_output_bytes"] == rows["on"]["resident_output_bytes"]
    assert rows["expandable-released"]["resident_output_bytes"] == rows["off"]["resident_output_bytes"]


def test_a_starred_variant_keeps_its_star_where_names_are_cut() -> None:
    """Rows that ran as another keep the ``*`` of their footnote in a table cut to fit; the footnote
    (wrapped) fits too."""
    from sglang_bcg_plugin.bench.output import format_table

    rows = _gpu_rows(["breakable", "full"], ["off", "on", "inductor-expandable-released"])
    for r in rows:
        if r.variant == "inductor-expandable-released":
            r.ran_as, r.ran_as_reason = "'sharing off, Inductor first'", "CUDA-only: " + "a long reason " * 10
    for width in (120, 80, 60):
        text = format_table(rows, width=width)
        lines = text.splitlines()
        assert _widest(text) <= width
        cells = [line.split()[1] for line in lines[3:7]]
        assert cells[0] == "off" and cells[1] == "on" and cells[2].endswith("*") and "*" not in "".join(cells[:2])
        assert sum(line.startswith("inductor-expandable-released*: ran as 'sharing off") for line in lines) == 1
