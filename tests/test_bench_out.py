"""``--out``: one run holds the folder (a lock file), bench.json and bench.png are replaced as one
pair (a failure or Ctrl-C between the two renames leaves the old pair), Ctrl-C is one line."""

from __future__ import annotations

import errno
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import pytest

from sglang_bcg_plugin.bench import outdir
from sglang_bcg_plugin.bench.outdir import LOCK, OutputWriteError, hold, write_pair
from sglang_bcg_plugin.cli import main
from sglang_bcg_plugin.bench.usage import UsageError

#: Its Ctrl-C and live-lock tests are timing tests: under .ci/run no other run's test beside them.
pytestmark = pytest.mark.alone

ROOT = Path(__file__).resolve().parents[1]
TINY = ["bench", "--backends", "full", "--variants", "on", "--max-tokens", "8", "--hidden", "16", "--layers", "1",
        "--repeats", "1", "--no-progress"]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def _default_sigint() -> None:
    """Ctrl-C as a terminal delivers it, also where the tests were started in the background
    (a non-interactive shell starts ``&`` jobs with SIGINT ignored, and children inherit that)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _cli(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "sglang_bcg_plugin", *args], env=_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_default_sigint)


@pytest.fixture(autouse=True)
def python_sigint() -> Iterator[None]:
    """Python's own Ctrl-C handler in this process for each test (see :func:`_default_sigint`)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _error_lines(err: str) -> list[str]:
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if line.startswith("error:")]


def _old_pair(out: Path) -> tuple[bytes, bytes]:
    out.mkdir(exist_ok=True)
    (out / "bench.json").write_text('{"old": true}\n')
    (out / "bench.png").write_bytes(b"old png")
    return (out / "bench.json").read_bytes(), (out / "bench.png").read_bytes()


def _pair(out: Path) -> tuple[bytes, bytes | None]:
    png = out / "bench.png"
    return (out / "bench.json").read_bytes(), png.read_bytes() if png.exists() else None


def _no_leftovers(out: Path) -> None:
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []


def _writers(png: bool = True) -> tuple[Any, Any]:
    def write_json(path: Path) -> None:
        path.write_text('{"new": true}\n')

    def write_png(path: Path) -> bool:
        if png:
            path.write_bytes(b"new png")
        return png

    return write_json, write_png


def test_pair_replaces_the_old_pair(tmp_path: Path) -> None:
    _old_pair(tmp_path)
    assert write_pair(tmp_path, *_writers()) == [tmp_path / "bench.json", tmp_path / "bench.png"]
    assert _pair(tmp_path) == (b'{"new": true}\n', b"new png")
    _no_leftovers(tmp_path)


def test_without_a_plot_the_old_png_goes(tmp_path: Path) -> None:
    """No stale png beside a new json: the old one is removed with the json's rename."""
    _old_pair(tmp_path)
    assert write_pair(tmp_path, *_writers(png=False)) == [tmp_path / "bench.json"]
    assert _pair(tmp_path) == (b'{"new": true}\n', None)
    _no_leftovers(tmp_path)


@pytest.mark.parametrize("png", [True, False])
@pytest.mark.parametrize("failing_call", [1, 2, 3])
def test_a_failure_between_the_two_writes_keeps_the_old_pair(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing_call: int, png: bool
) -> None:
    """Rename 1 moves the old png aside, 2 puts the new png (or, without a plot, the json), 3 the json."""
    old = _old_pair(tmp_path)
    real, calls = os.replace, []

    def replace(src: Any, dst: Any) -> None:
        calls.append(dst)
        if len(calls) == failing_call:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(src, dst)

    monkeypatch.setattr(outdir.os, "replace", replace)
    if not png and failing_call == 3:  # only two renames without a plot
        write_pair(tmp_path, *_writers(png))
        assert _pair(tmp_path) == (b'{"new": true}\n', None)
        return
    with pytest.raises(OutputWriteError, match=r"could not write bench.json and bench.png into .*No space left on device.*keeps its previous pair"):
        write_pair(tmp_path, *_writers(png))
    monkeypatch.undo()
    assert _pair(tmp_path) == old
    _no_leftovers(tmp_path)


def test_a_failed_render_replaces_nothing(tmp_path: Path) -> None:
    old = _old_pair(tmp_path)

    def full(path: Path) -> None:
        path.write_text("{")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OutputWriteError):
        write_pair(tmp_path, full, _writers()[1])
    assert _pair(tmp_path) == old
    _no_leftovers(tmp_path)


def test_ctrl_c_between_the_two_renames_waits_for_the_pair(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGINT after the png's rename is held back until the json is in place, then delivered."""
    _old_pair(tmp_path)
    real = os.replace

    def replace(src: Any, dst: Any) -> None:
        real(src, dst)
        if Path(dst).name == "bench.png":
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(outdir.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        write_pair(tmp_path, *_writers())
    assert _pair(tmp_path) == (b'{"new": true}\n', b"new png")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_pair_from_another_thread(tmp_path: Path) -> None:
    """Off the main thread no signal handler can be set: the pair is still written."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            write_pair(tmp_path, *_writers())
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert not errors and _pair(tmp_path) == (b'{"new": true}\n', b"new png")


def test_write_failure_through_the_cli_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    old = _old_pair(tmp_path)
    real = os.replace

    def replace(src: Any, dst: Any) -> None:
        if Path(dst).name == "bench.json":
            raise OSError(errno.ENOSPC, "No space left on device")
        real(src, dst)

    monkeypatch.setattr(outdir.os, "replace", replace)
    assert main([*TINY, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert len(_error_lines(err)) == 1 and "No space left on device" in err
    assert _pair(tmp_path) == old
    _no_leftovers(tmp_path)


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    return int(proc.stdout)


def test_a_stale_lock_is_taken_over(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / LOCK).write_text(f"{_dead_pid()}\n")
    (tmp_path / ".bench.123.456.tmp.png").write_bytes(b"left by a killed run")
    assert main([*TINY, "--out", str(tmp_path)]) == 0
    capsys.readouterr()
    assert (tmp_path / "bench.json").exists() and (tmp_path / "bench.png").exists()
    _no_leftovers(tmp_path)  # the lock released, the dead run's temporary file removed


def test_lock_without_a_pid(tmp_path: Path) -> None:
    """A lock being written (no pid yet) is held; an old one without a pid is stale."""
    lock = tmp_path / LOCK
    lock.write_text("")
    with pytest.raises(UsageError, match="in use by another sglang-bcg bench \\(a run starting now"), hold(tmp_path):
        pass  # pragma: no cover
    old = time.time() - 2 * outdir.YOUNG_LOCK_S
    os.utime(lock, (old, old))
    with hold(tmp_path):
        assert lock.read_text() == f"{os.getpid()}\n"
    assert not lock.exists()


def test_take_over_races(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lock = tmp_path / LOCK
    outdir._take_over(tmp_path, lock, 123)  # gone already: another run took it over
    lock.write_text(f"{os.getpid()}\n")  # a live run replaced the stale lock meanwhile: put back
    with pytest.raises(UsageError, match=f"pid {os.getpid()}"):
        outdir._take_over(tmp_path, lock, 123)
    assert lock.read_text() == f"{os.getpid()}\n" and sorted(p.name for p in tmp_path.iterdir()) == [LOCK]
    lock.unlink()

    def vanishing(path: Path) -> int | None:
        raise FileNotFoundError(path)

    monkeypatch.setattr(outdir, "_read_pid", vanishing)  # released between open and read, every time
    lock.write_text("1\n")
    with pytest.raises(UsageError, match="a run starting now"), hold(tmp_path):
        pass  # pragma: no cover


def test_unusable_lock_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / LOCK).mkdir()
    assert main([*TINY, "--out", str(tmp_path)]) == 2
    assert "cannot use its lock file .bench.lock" in _error_lines(capsys.readouterr().err)[0]


def test_lock_of_another_users_process(monkeypatch: pytest.MonkeyPatch) -> None:
    def denied(pid: int, sig: int) -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(outdir.os, "kill", denied)
    assert outdir._alive(1)


_HOLDER = """
import pathlib, sys, time
from sglang_bcg_plugin.bench import runner
go, real = pathlib.Path(sys.argv[1]), runner.warm_up
def wait(*args, **kwargs):
    while not go.exists():
        time.sleep(0.05)
    return real(*args, **kwargs)
runner.warm_up = wait
from sglang_bcg_plugin.cli import main
sys.exit(main(sys.argv[2:]))
"""


def test_a_folder_another_live_run_holds_is_refused(tmp_path: Path) -> None:
    """Two real processes on one --out: the second is refused (one line, exit 2) while the first
    holds the folder; the first then writes its pair and releases the lock."""
    out, go = tmp_path / "out", tmp_path / "go"
    first = subprocess.Popen([sys.executable, "-c", _HOLDER, str(go), *TINY, "--out", str(out)], env=_env(), text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not (out / LOCK).exists():
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.05)
        second = _cli(*TINY, "--out", str(out))
        _, err = second.communicate(timeout=60)
        assert second.returncode == 2, err
        lines = _error_lines(err)
        assert lines == [line for line in err.splitlines() if line.strip()], err  # nothing else: before any work
        assert f"is in use by another sglang-bcg bench (pid {first.pid}," in lines[0]
        assert not (out / "bench.json").exists()
        go.touch()
        _, err = first.communicate(timeout=120)
        assert first.returncode == 0, err
    finally:
        if first.poll() is None:  # pragma: no cover - only when an assertion failed
            first.kill()
            first.wait()
    assert (out / "bench.json").exists() and (out / "bench.png").exists()
    _no_leftovers(out)


def _stderr_until(proc: subprocess.Popen[str], text: str, timeout: float = 180) -> str:
    """Read the child's stderr (progress bars rewrite one line: no newline to wait for) until
    ``text`` shows; what was read."""
    assert proc.stderr is not None
    fd, seen, deadline = proc.stderr.fileno(), b"", time.monotonic() + timeout
    while text.encode() not in seen:
        left = deadline - time.monotonic()
        assert left > 0 and proc.poll() is None, seen
        if select.select([fd], [], [], left)[0]:
            chunk = os.read(fd, 4096)
            assert chunk, seen
            seen += chunk
    return seen.decode()


def test_ctrl_c_is_one_line_and_exit_130(tmp_path: Path) -> None:
    """A real SIGINT during the bench: `error: interrupted`, exit 130, the lock released.

    Sent once the measured variant has started capturing (its progress bar shows), not while
    the warm-up still imports: a Ctrl-C that lands in a finalizer there is lost by CPython
    itself ("Exception ignored"), which would leave this test waiting."""
    proc = _cli("bench", "--backends", "full", "--variants", "off", "--max-tokens", "64", "--hidden", "16",
                "--layers", "1", "--repeats", "100000000", "--out", str(tmp_path))
    try:
        _stderr_until(proc, "full/off")  # the measured variant is capturing
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:  # pragma: no cover - only when an assertion failed
            proc.kill()
            proc.communicate()  # its pipes closed too
    assert proc.returncode == 130, err
    assert _error_lines(err) == ["error: interrupted"] and err.strip().splitlines()[-1] == "error: interrupted"
    assert not (tmp_path / "bench.json").exists()
    _no_leftovers(tmp_path)


def test_ctrl_c_with_debug_keeps_the_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--debug`` adds the traceback and keeps the exit code: 130, after the same ``error:`` line."""
    from sglang_bcg_plugin.bench import runner

    def interrupt(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "warm_up", interrupt)
    assert main([*TINY, "--debug"]) == 130
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "KeyboardInterrupt" in err
    assert [line for line in err.splitlines() if line.startswith("error:")] == ["error: interrupted"]
    assert err.strip().splitlines()[-1] == "error: interrupted"


def test_ctrl_c_without_debug_in_process(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from sglang_bcg_plugin.bench import runner

    def interrupt(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "warm_up", interrupt)
    assert main([*TINY, "--out", str(tmp_path)]) == 130
    assert _error_lines(capsys.readouterr().err) == ["error: interrupted"]
    _no_leftovers(tmp_path)  # the lock released


def test_a_lock_taken_from_us_is_left_alone(tmp_path: Path) -> None:
    with hold(tmp_path):
        (tmp_path / LOCK).write_text("1\n")  # removed by hand and taken by another run
    assert (tmp_path / LOCK).read_text() == "1\n"


def test_a_failure_with_no_old_pair_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.replace

    def replace(src: Any, dst: Any) -> None:
        if Path(dst).name == "bench.json":
            raise OSError(errno.EIO, "Input/output error")
        real(src, dst)

    monkeypatch.setattr(outdir.os, "replace", replace)
    with pytest.raises(OutputWriteError, match="Input/output error"):
        write_pair(tmp_path, *_writers())
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_during_code_run_from_a_string_still_exits_130(tmp_path: Path) -> None:
    """Under ``python -m`` CPython ends the process by SIGINT (status -2) after a clean exit when
    the caught KeyboardInterrupt came through ``exec`` of source (dataclasses and namedtuples do
    that while modules import, where a real Ctrl-C often lands): the command still exits 130."""
    (tmp_path / "sitecustomize.py").write_text(
        "import sglang_bcg_plugin.bench.runner as r\n"
        "def warm_up(*args, **kwargs):\n"
        "    exec('raise KeyboardInterrupt')\n"
        "r.warm_up = warm_up\n"
    )
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    proc = subprocess.run([sys.executable, "-m", "sglang_bcg_plugin", *TINY], env=env, text=True,
                          capture_output=True, timeout=120, check=False)
    assert proc.returncode == 130, (proc.returncode, proc.stderr)
    assert _error_lines(proc.stderr) == ["error: interrupted"]
