"""``sglang-bcg``: every bad input is one ``error:`` line before any work; --version; --debug."""

from __future__ import annotations

import json
import re

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import sglang_bcg_plugin
from sglang_bcg_plugin.bench import budget, config, outdir, runner
from sglang_bcg_plugin.cli import main
from sglang_bcg_plugin.bench.sizes import capture_size_stats
from sglang_bcg_plugin.bench.usage import UsageError

TINY = ["--hidden", "16", "--layers", "1", "--max-tokens", "8", "--repeats", "1", "--no-progress"]


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any benchmark work fails the test: errors must come before it."""

    def forbidden(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("benchmark work started before the arguments were checked")

    monkeypatch.setattr(runner, "warm_up", forbidden)
    monkeypatch.setattr(runner, "run_variant", forbidden)


def _one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


def _file(tmp_path: Path) -> Path:
    f = tmp_path / "a-file"
    f.write_text("x")
    return f


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (lambda t: ["--out", str(_file(t))], "is an existing file; give a directory"),
        (lambda t: ["--out", str(_file(t) / "sub")], "is not a writable directory"),
        (lambda t: ["--max-tokens", "100000000"], "--max-tokens 100000000 needs at least"),
        (lambda t: ["--max-tokens", "3"], "--max-tokens 3 is below 4, the smallest prefill capture size"),
        (lambda t: ["--heads", "3"], "--hidden 128 (default) is not a multiple of --heads 3"),
        (lambda t: ["--kv-heads", "3"], "--heads 4 (default) is not a multiple of --kv-heads 3"),
        (lambda t: ["--hidden", "64", "--heads", "8", "--kv-heads", "3"], "use --kv-heads among 1, 2, 4, 8"),
        (lambda t: ["--device", "tpu"], "--device 'tpu' is not supported; use cpu, cuda or cuda:N"),
        (lambda t: ["--device", "cuda:x"], "--device 'cuda:x' is not supported"),
        (lambda t: ["--backends", ""], "--backends is empty; give a comma-separated list of: breakable, full, piecewise"),
        (lambda t: ["--backends", "full,,breakable"], "has an empty entry"),
        (lambda t: ["--variants", "on,on"], "--variants 'on,on' lists on more than once; give each once"),
        (lambda t: ["--variants", " "], "--variants is empty"),
        (lambda t: ["--variants", "inductor", "--backends", "breakable"],
         "--variants inductor is run only by --backends full or piecewise, and --backends breakable has none of them: "
         "add full or piecewise to --backends or drop inductor from --variants"),
        (lambda t: ["--variants", "off,inductor", "--backends", "breakable"], "--variants inductor is run only by"),
        (lambda t: ["--variants", "off,inductor,inductor-released", "--backends", "breakable,graph-trees"],
         "--variants inductor, inductor-released are run only by --backends full or piecewise"),
    ],
)
def test_bad_bench_input_is_one_line_before_any_work(
    argv: Callable[[Path], list[str]], expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], no_work: None
) -> None:
    assert main(["bench", *argv(tmp_path)]) == 2
    assert expected in _one_error_line(capsys)


def test_bad_env_value_is_an_error(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], no_work: None) -> None:
    monkeypatch.setenv("SGLANG_ENABLE_BCG_SHARED_OUTPUT", "maybe")
    assert main(["bench"]) == 2
    line = _one_error_line(capsys)
    assert "SGLANG_ENABLE_BCG_SHARED_OUTPUT='maybe' is not an output mode" in line and "released" in line and "unset it" in line
    monkeypatch.setenv("SGLANG_ENABLE_BCG_SHARED_OUTPUT", "y" * 100_000)
    assert main(["bench"]) == 2
    line = _one_error_line(capsys)
    assert "='" + "y" * 80 + "'… (100000 characters) is not an output mode" in line and len(line) < 400


def test_unwritable_out_is_caught_up_front(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str], no_work: None
) -> None:
    real_open = os.open

    def denied(path: Any, *args: Any, **kwargs: Any) -> Any:
        if ".bench.probe." in str(path):  # the probe file of the check
            raise PermissionError(13, "Permission denied")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(outdir.os, "open", denied)  # root ignores chmod; simulate it
    assert main(["bench", "--out", str(tmp_path / "new")]) == 2
    assert "not a writable directory (Permission denied)" in _one_error_line(capsys)


def test_out_with_a_directory_named_bench_json(tmp_path: Path, capsys: pytest.CaptureFixture[str], no_work: None) -> None:
    (tmp_path / "bench.json").mkdir()
    assert main(["bench", "--out", str(tmp_path)]) == 2
    assert "bench.json is a directory; remove it or give another --out" in _one_error_line(capsys)


def test_out_is_not_created_when_another_argument_is_bad(tmp_path: Path, capsys: pytest.CaptureFixture[str], no_work: None) -> None:
    assert main(["bench", "--out", str(tmp_path / "new" / "deeper"), "--heads", "3"]) == 2
    assert not (tmp_path / "new").exists()
    capsys.readouterr()


def test_cuda_device_index_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert config._device("cuda") == "cuda" and config._device("cuda:0") == "cuda:0"
    with pytest.raises(UsageError, match="cuda:1: this machine has 1 CUDA device"):
        config._device("cuda:1")


def test_nothing_fits_and_unknown_memory(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], no_work: None) -> None:
    monkeypatch.setattr(budget, "available_bytes", lambda device: (1000, "this machine has 1000 B of RAM"))
    assert main(["bench"]) == 2
    line = _one_error_line(capsys)
    assert "but this machine has 1000 B of RAM; lower --hidden, --layers or --intermediate" in line

    def no_sysconf(name: str) -> int:
        raise ValueError(name)

    monkeypatch.undo()
    monkeypatch.setattr(budget.os, "sysconf", no_sysconf)
    assert budget.available_bytes("cpu") is None
    model = config.ModelShape(16, 1, 4, 2, 4, 16, torch.float32, "cpu")
    budget.check_fits(model, 8, ["off"])  # unknown memory: no check


def test_budget_suggests_what_fits_and_reads_cuda_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    model = config.ModelShape(128, 2, 4, 2, 32, 128, torch.float32, "cpu")
    need = budget.estimate_bytes(model, config.prefill_capture_sizes(1024), ["off", "on"])
    assert need == budget.estimate_bytes(model, capture_size_stats(1024), ["off", "on"])
    monkeypatch.setattr(budget, "available_bytes", lambda device: (int(need / budget.FRACTION) + 1, "here"))
    budget.check_fits(model, 1024, ["off", "on"])
    with pytest.raises(UsageError, match=r"--max-tokens 2048 needs at least .* \(42 capture sizes: .*use --max-tokens 1024 or less"):
        budget.check_fits(model, 2048, ["off", "on"])
    with pytest.raises(UsageError, match=r"\(1 capture size: "):  # one size: no plural
        budget.check_fits(config.ModelShape(2**20, 64, 4, 2, 2**18, 2**20, torch.float32, "cpu"), 4, ["off"])
    assert budget.estimate_bytes(model, [8, 4], ["floor"]) < budget.estimate_bytes(model, [8, 4], ["on"])
    assert budget.estimate_bytes(model, [8, 4], ["on"]) < budget.estimate_bytes(model, [8, 4], ["off"])
    monkeypatch.undo()
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (3 * 2**30, 4 * 2**30))
    assert budget.available_bytes("cuda:0") == (3 * 2**30, "cuda:0 has 3.0 GiB free")
    assert budget.human_bytes(5 * 2**50) == "5.0 PiB" and budget.human_bytes(12) == "12 B"


def test_debug_and_verbose_show_the_traceback(no_work: None, capsys: pytest.CaptureFixture[str]) -> None:
    """The traceback, then the same ``error:`` line and the same exit code 2."""
    for argv in (["bench", "--debug", "--device", "tpu"], ["--debug", "bench", "--device", "tpu"], ["-v", "bench", "--device", "tpu"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("Traceback") and "UsageError: --device 'tpu'" in err, err
        assert err.splitlines()[-1] == "error: --device 'tpu' is not supported; use cpu, cuda or cuda:N"


def test_argparse_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["bench", "--max-tokens", "0"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: argument --max-tokens: expected a positive integer, got '0' (see sglang-bcg bench --help)"]


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"sglang-bcg {sglang_bcg_plugin.__version__} (torch {torch.__version__})"


def test_version_comes_from_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    from sglang_bcg_plugin import _version

    assert sglang_bcg_plugin.__version__ == importlib.metadata.version("sglang-bcg-plugin")

    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(_version.importlib.metadata, "version", missing)
    assert _version.package_version() == "0+unknown"


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore"), 1),
        (RuntimeError("[enforce fail] DefaultCPUAllocator: can't allocate memory: you tried"), 1),
    ],
)
def test_out_of_memory_is_one_line(exc: Exception, code: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def oom(*args: Any, **kwargs: Any) -> None:
        raise exc

    monkeypatch.setattr(runner, "warm_up", oom)
    assert main(["bench", *TINY]) == code
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("error: out of memory (") and "lower --max-tokens" in err
    assert main(["bench", "--debug", *TINY]) == code  # the traceback too, the same exit code
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("error: out of memory (")


def test_other_runtime_errors_keep_their_traceback(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def boom(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(runner, "warm_up", boom)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["bench", *TINY])
    capsys.readouterr()


def test_registration_error_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from sglang_bcg_plugin import get_plugin_manager, hookimpl
    from sglang_bcg_plugin.backends.full import FullBackend

    class Dup:
        @hookimpl
        def sglang_bcg_register_backends(self, registry: Any) -> None:
            registry.add("full", FullBackend)

    get_plugin_manager().register(Dup(), name="dup")
    assert main(["backends"]) == 2
    assert "backend name 'full' is claimed by two plugins" in _one_error_line(capsys)


def _fifo(t: Path) -> list[str]:
    os.mkfifo(t / "bench.json")
    return ["--out", str(t)]


def _dev_full(t: Path) -> list[str]:
    (t / "bench.json").symlink_to("/dev/full")
    return ["--out", str(t)]


#: Inputs that crashed, hung or were killed before: each is one error line before any work.
CRASHERS: list[tuple[Callable[[Path], list[str]], str]] = [
    (lambda t: ["--max-tokens", "99999999999999999999999"], "--max-tokens 99999999999999999999999 is beyond any machine's memory"),
    (lambda t: ["--max-tokens", "1000000000000"], "--max-tokens 1000000000000 needs at least"),
    (lambda t: ["--model", "llama", "--hidden", "63"], "--hidden 63 is not a multiple of --heads 4 (default) (transformers' LlamaConfig requires it"),
    (lambda t: ["--model", "llama", "--hidden", "63", "--head-dim", "7"], "use --heads among 1, 3, 7, 9, 21, 63"),
    (lambda t: ["--model", "llama", "--heads", "4096", "--kv-heads", "1", "--head-dim", "1"], "--hidden 64 (default) is not a multiple of --heads 4096"),
    (lambda t: ["--model", "llama", "--head-dim", "3"], "--head-dim 3 is odd; transformers' rotary embedding"),
    (lambda t: ["--model", "llama", "--head-dim", "1", "--backends", "piecewise"], "needs an even head size: use --head-dim 2"),
    (lambda t: ["--out", str(t / ("a" * 300))], "characters) is not a writable directory (File name too long)"),
    (lambda t: ["--out", ""], "--out is empty; give a directory"),
    (_fifo, "bench.json is not a regular file (a FIFO, socket or device); remove it or give another --out"),
    (_dev_full, "bench.json is not a regular file"),
    (lambda t: ["--backends", "x" * 100_000], "… (100004 characters); give a comma-separated list of"),
]


@pytest.mark.parametrize(("argv", "expected"), CRASHERS)
def test_former_crashes_are_one_line_before_any_work(
    argv: Callable[[Path], list[str]], expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], no_work: None
) -> None:
    assert main(["bench", *argv(tmp_path)]) == 2
    line = _one_error_line(capsys)
    assert expected in line and len(line) < 400


def test_former_crashes_through_the_real_command(tmp_path: Path) -> None:
    """The real ``python -m sglang_bcg_plugin`` (run concurrently): exit 2, stderr exactly one
    ``error:`` line, nothing on stdout; argparse's own errors in the same format."""
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    cases = [CRASHERS[i] for i in (0, 6, 9)]  # OverflowError, a dynamo traceback, a hang (FIFO) before
    cases.append((lambda t: ["--model", "m" * 5000], "argument --model: invalid choice: '" + "m" * 80 + "…'"))
    procs = []
    for i, (argv, expected) in enumerate(cases):
        (tmp_path / str(i)).mkdir()
        cmd = [sys.executable, "-m", "sglang_bcg_plugin", "bench", *argv(tmp_path / str(i))]
        procs.append((subprocess.Popen(cmd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE), expected))
    for proc, expected in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 2 and out == "", (expected, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], err


def test_full_out_folder_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str], no_work: None) -> None:
    class Full:
        f_bavail, f_frsize = 3, 4096

    monkeypatch.setattr(outdir.os, "statvfs", lambda path: Full())
    assert main(["bench", "--out", str(tmp_path)]) == 2
    assert "has 12.0 KiB free; bench.json and bench.png need up to 1.0 MiB" in _one_error_line(capsys)


def test_max_tokens_between_sizes_is_noted(capsys: pytest.CaptureFixture[str]) -> None:
    from sglang_bcg_plugin.cli import _parser

    backends = ["breakable", "full", "piecewise"]
    # off,on: variants that run as themselves on every engine (CPU's default released has its own note)
    cfg = config.build_config(_parser().parse_args(["bench", "--variants", "off,on", "--max-tokens", "300"]), backends)
    note = "note: --max-tokens 300 is not one of SGLang's prefill capture sizes; the largest below it, 288, is captured"
    assert cfg.notes == [note] and max(cfg.sizes) == 288 and cfg.summary()["max_tokens"] == 288
    assert config.build_config(_parser().parse_args(["bench", "--variants", "off,on", "--max-tokens", "288"]),
                               backends).notes == []
    assert main(["bench", "--backends", "full", "--variants", "on", "--max-tokens", "5", "--hidden", "16",
                 "--layers", "1", "--repeats", "1", "--no-progress"]) == 0
    assert "note: --max-tokens 5 is not one of SGLang's prefill capture sizes; the largest below it, 4, is captured" in capsys.readouterr().err


def test_a_variant_one_chosen_backend_skips_is_noted() -> None:
    """``inductor`` with breakable and full: full runs it, breakable's skip is one note; ``graph-trees``
    alone ignores --variants (its one reference row)."""
    from sglang_bcg_plugin.cli import _parser

    names = ["breakable", "full", "piecewise"]
    cfg = config.build_config(_parser().parse_args(["bench", "--variants", "off,inductor", "--backends", "breakable,full"]), names)
    assert cfg.notes == ["note: breakable does not run --variants inductor (no compiled callable): no row for it"]
    cfg = config.build_config(_parser().parse_args(["bench", "--variants", "inductor", "--backends", "graph-trees"]), [*names, "graph-trees"])
    assert cfg.notes == []
    assert config._or(["full"]) == "full" and config._or(["a", "b", "c"]) == "a, b or c"


def test_help_and_getting_started_list_every_bench_option() -> None:
    """Every bench flag, variant and backend is in ``--help`` and in docs/getting-started.md."""
    from sglang_bcg_plugin.bench.runner import GRAPH_TREES, VARIANTS
    from sglang_bcg_plugin.cli import _parser
    from sglang_bcg_plugin.registry import available_backends

    # private: argparse has no public API that lists a parser's subcommands and their options
    bench = _parser()._subparsers._group_actions[0].choices["bench"]  # type: ignore[union-attr]
    flags = [s for a in bench._actions for s in a.option_strings if s not in ("-h", "--help")]
    doc = (Path(__file__).resolve().parents[1] / "docs" / "getting-started.md").read_text()
    assert "--model" in flags and "-v" in flags and "--debug" in flags
    assert [f for f in flags if f"`{f}" not in doc] == []
    assert [v for v in VARIANTS if f"`{v}`" not in doc] == []
    assert [b for b in [*available_backends(), GRAPH_TREES] if f"`{b}`" not in doc] == []
    help_text = re.sub(r"-\s+", "-", " ".join(bench.format_help().split()))  # argparse wraps at hyphens
    assert f"comma-separated of {', '.join(VARIANTS)}" in help_text and "released" in help_text


def test_help_and_getting_started_say_what_each_variant_means(capsys: pytest.CaptureFixture[str]) -> None:
    """One line per variant, the same words in ``--help`` and in docs/getting-started.md."""
    from sglang_bcg_plugin.bench.runner import VARIANTS

    with pytest.raises(SystemExit) as info:
        main(["bench", "--help"])
    assert info.value.code == 0
    help_lines = [" ".join(line.split()) for line in capsys.readouterr().out.splitlines()]
    doc = (Path(__file__).resolve().parents[1] / "docs" / "getting-started.md").read_text()
    for name, variant in VARIANTS.items():
        assert f"{name} {variant.meaning}" in help_lines, name
        assert f"  - `{name}`: {variant.meaning}\n" in doc, name
    assert "graph-trees has no output modes: it ignores --variants and adds one row (reference)." in help_lines


def test_doctor_takes_no_argument(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["doctor", "foo"])
    assert info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == ["error: unrecognized arguments: foo (see sglang-bcg --help)"]


def test_doctor_runs_the_doctor(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang_bcg_plugin.sglang import doctor

    seen: list[object] = []
    monkeypatch.setattr(doctor, "doctor_main", lambda argv: seen.append(argv) or 3)
    assert main(["doctor"]) == 3 and seen == [[]]


def test_fits_in_memory_counts_what_the_cpu_engines_keep(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], no_work: None
) -> None:
    """``--hidden 512 --layers 2 --max-tokens 4096 --backends breakable`` peaked at 2.78 GB RSS on CPU
    (eager segments keep every size's activations) and was estimated at 0.29 GiB: with 1.5 GiB it is
    refused now, naming what the tape keeps and what fits; Full fits there; on CUDA no tape is kept."""
    monkeypatch.setattr(budget, "available_bytes", lambda device: (int(1.5 * 2**30), "this machine has 1.5 GiB of RAM"))
    args = ["bench", "--hidden", "512", "--layers", "2", "--max-tokens", "4096"]
    assert main([*args, "--backends", "breakable"]) == 2
    line = _one_error_line(capsys)
    assert re.search(r"--max-tokens 4096 needs at least 2\.\d GiB \(50 capture sizes: .*, 2\.0 GiB the eager segments keep of "
                     r"every size\) but this machine has 1\.5 GiB of RAM; use --max-tokens \d+ or less", line), line
    from sglang_bcg_plugin.cli import _parser

    for fits in ("full", "piecewise"):  # Piecewise keeps only what crosses its pieces
        cfg = config.build_config(_parser().parse_args([*args, "--backends", fits]), ["breakable", "full", "piecewise"])
        assert max(cfg.sizes) == 4096
    model = config.ModelShape(512, 2, 4, 2, 128, 512, torch.float32, "cpu")
    stats = capture_size_stats(4096)
    ours = budget.estimate_bytes(model, stats, ["off"], backends=["breakable"])
    assert ours > 7 * budget.estimate_bytes(model, stats, ["off"], backends=["full"])
    assert ours == budget.estimate_bytes(model, stats, ["off"], backends=["full", "breakable", "piecewise"])
    assert budget.estimate_bytes(model, stats, ["off"], backends=["piecewise"]) < ours
    assert budget.estimate_bytes(model, stats, ["off"], backends=["breakable"], workload="llama") > ours
    gpu = config.ModelShape(512, 2, 4, 2, 128, 512, torch.float32, "cuda")
    assert budget.tape_kept_bytes(gpu, stats, ["breakable"]) == 0


def test_docs_state_the_sglang_extra_as_pyproject_does() -> None:
    """docs/index.md said the ``sglang`` extra pins 0.5.23; it is a range."""
    import tomllib

    root = Path(__file__).resolve().parents[1]
    (spec,) = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]["sglang"]
    index = " ".join((root / "docs" / "index.md").read_text().split())
    assert f"`sglang` (`{spec}`" in index and "pins" not in index.split("## Dependencies")[1].split("##")[0]
    start = " ".join((root / "docs" / "getting-started.md").read_text().split())
    assert "~10 s" not in start and "on a first run" in start


def test_the_cold_row_is_printed_and_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Where the warm-up returns its first schedule (CUDA), stderr says what it lost against the
    forecast with the driver's share, and bench.json holds it as ``cold``."""
    from sglang_bcg_plugin.bench.runner import BenchRow

    row = BenchRow("breakable", "released", "released", 2, 8, 0, 0, 400 << 20, 1.0, 1.0, 0.0, 0)
    row.forecast = {"mode": "released", "lasting_bytes": 100 << 20, "modes": {"released": {"total_bytes": 490 << 20}}}
    monkeypatch.setattr(runner, "warm_up", lambda *a, **k: row)
    assert main(["bench", "--backends", "full", "--variants", "on", *TINY, "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert ("first schedule of this process (breakable/released, cold): lost 500.0 MiB, forecast with the "
            "driver's share 490.0 MiB (-2.0 %)") in err
    cold = json.loads((tmp_path / "bench.json").read_text())["cold"]
    assert cold == {"backend": "breakable", "variant": "released", "num_sizes": 2, "lost_bytes": 500 << 20,
                    "forecast_bytes": 490 << 20, "forecast_error": pytest.approx(-0.02)}
