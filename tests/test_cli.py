"""``sglang-bcg``: every bad input is one ``error:`` line before any work; --version; --debug."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import sglang_bcg_plugin
from sglang_bcg_plugin.bench import budget, config, outdir, runner
from sglang_bcg_plugin.cli import main
from sglang_bcg_plugin.bench.sizes import capture_size_stats
from sglang_bcg_plugin.errors import UsageError

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


def test_unwritable_out_is_caught_up_front(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str], no_work: None
) -> None:
    def denied(*args: Any, **kwargs: Any) -> Any:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(outdir, "_probe", denied)  # root ignores chmod; simulate it
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


def test_debug_and_verbose_show_the_traceback(no_work: None) -> None:
    for argv in (["bench", "--debug", "--device", "tpu"], ["--debug", "bench", "--device", "tpu"], ["-v", "bench", "--device", "tpu"]):
        with pytest.raises(UsageError, match="tpu"):
            main(argv)


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
    with pytest.raises(type(exc)):
        main(["bench", "--debug", *TINY])


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
