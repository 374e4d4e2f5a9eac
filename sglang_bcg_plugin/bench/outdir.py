"""``--out``: checked before any work, held by one run at a time (a pid lock file), written as one
``bench.json``/``bench.png`` pair (docs/getting-started.md)."""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from .budget import human_bytes
from .usage import UsageError, shown

BENCH_JSON, BENCH_PNG, LOCK = "bench.json", "bench.png", ".bench.lock"
#: Free bytes ``--out`` must have (bench.json of the CUDA defaults is about 0.3 MiB).
MIN_FREE_BYTES = 1 << 20
#: A lock file without a pid yet (being written) counts as held for this long.
YOUNG_LOCK_S = 10.0


class OutputWriteError(UsageError):
    """``bench.json``/``bench.png`` could not be written; the folder keeps its old pair."""


def check_out_dir(raw: str) -> Path:
    """Create ``--out`` (parents too) and prove it can take the pair, before the bench.
    :raises UsageError: it cannot (the message says why)."""
    if not raw:
        raise UsageError("--out is empty; give a directory for bench.json and bench.png (--out . for the current one)")
    out = Path(raw)
    try:
        if out.exists() and not out.is_dir():
            raise UsageError(f"--out {shown(raw)} is an existing file; give a directory (bench.json and bench.png are "
                             "written into it)")
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".bench.probe.{os.getpid()}"  # a file can be created and removed there
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        probe.unlink()
        free = (st := os.statvfs(out)).f_bavail * st.f_frsize if hasattr(os, "statvfs") else None
        for name in (BENCH_JSON, BENCH_PNG):  # must be a regular file (or link to one), if there
            try:
                mode = os.stat(out / name).st_mode
            except FileNotFoundError:
                continue  # absent, or a dangling link: the rename replaces it
            if not stat.S_ISREG(mode):
                kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file (a FIFO, socket or device)"
                raise UsageError(f"--out {shown(raw)}: {name} is {kind}; remove it or give another --out")
    except OSError as exc:
        msg = f"--out {shown(raw)} is not a writable directory ({exc.strerror or exc}); give one you can write to"
        raise UsageError(msg) from None
    if free is not None and free < MIN_FREE_BYTES:
        raise UsageError(f"--out {shown(raw)} has {human_bytes(free)} free; bench.json and bench.png need up to "
                         f"{human_bytes(MIN_FREE_BYTES)}: free some space or give another --out")
    return out


def _read_pid(path: Path) -> int | None:
    """The pid in a lock file; ``None`` when it holds none (yet)."""
    text = path.read_text(errors="replace").strip()
    return int(text) if text.isdigit() else None


def _alive(pid: int) -> bool:
    if os.name == "nt":  # pragma: no cover - os.kill(pid, 0) would terminate it
        return True
    try:
        with contextlib.suppress(PermissionError):  # alive, another user's
            os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _in_use(out: Path, lock: Path, pid: int | None) -> UsageError:
    who = f"pid {pid}" if pid is not None else "a run starting now"
    return UsageError(f"--out {shown(str(out))} is in use by another sglang-bcg bench ({who}, lock file {lock.name}); "
                      f"wait for it to finish or give another --out (remove {lock.name} only if no bench runs there)")


def _take_over(out: Path, lock: Path, stale: int | None) -> None:
    """Move a dead run's lock aside, unless a live run replaced it meanwhile."""
    aside = out / f"{LOCK}.{os.getpid()}.stale"
    try:
        os.rename(lock, aside)
    except FileNotFoundError:
        return  # another run took it over first
    if _read_pid(aside) != stale:  # a live run's fresh lock: put it back
        os.replace(aside, lock)
        raise _in_use(out, lock, _read_pid(lock))
    aside.unlink()


@contextlib.contextmanager
def hold(out: Path) -> Iterator[None]:
    """Hold ``out`` for this run: a lock file with our pid, taken over from a dead run.
    :raises UsageError: another live run holds it."""
    lock = out / LOCK
    try:
        for _ in range(3):
            try:
                fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                break
            except FileExistsError:
                try:
                    pid = _read_pid(lock)
                    young = time.time() - lock.stat().st_mtime < YOUNG_LOCK_S
                except FileNotFoundError:
                    continue  # released meanwhile: try again
                if (pid is None and young) or (pid is not None and _alive(pid)):
                    raise _in_use(out, lock, pid) from None
                _take_over(out, lock, pid)
        else:
            raise _in_use(out, lock, None)
        with os.fdopen(fd, "w") as f:
            f.write(f"{os.getpid()}\n")
        for left in out.glob(".bench.*.tmp.*"):  # left by a killed run: we hold the folder now
            with contextlib.suppress(OSError):
                left.unlink()
    except OSError as exc:
        raise UsageError(f"--out {shown(str(out))}: cannot use its lock file {LOCK} ({exc.strerror or exc}); remove it "
                         "if no bench runs there, or give another --out") from None
    try:
        yield
    finally:
        with contextlib.suppress(OSError, ValueError):
            if _read_pid(lock) == os.getpid():
                lock.unlink()


@contextlib.contextmanager
def _sigint_held() -> Iterator[None]:
    """Hold a Ctrl-C back until the block is done, then deliver it (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if got:
            signal.raise_signal(signal.SIGINT)


def _temp(out: Path, label: str) -> Path:
    """A hidden temporary name in ``out``, unique to this process (``.bench.*.tmp.*``)."""
    return out / f".bench.{os.getpid()}.{time.monotonic_ns()}.tmp.{label}"


def write_pair(out: Path, write_json: Callable[[Path], None], write_png: Callable[[Path], bool]) -> list[Path]:
    """Write ``bench.png`` (when ``write_png`` makes one) and ``bench.json`` into ``out`` as one pair
    (renamed into place, the json last, Ctrl-C held back); the files written, the json first.
    :raises OutputWriteError: a write or rename failed; ``out`` keeps its old pair."""
    json_tmp, png_tmp = _temp(out, "json"), _temp(out, "png")
    try:
        made_png = write_png(png_tmp)
        write_json(json_tmp)
        for p in (json_tmp, png_tmp) if made_png else (json_tmp,):  # on disk before the renames
            with open(p, "rb") as f:
                os.fsync(f.fileno())
        png, placed = out / BENCH_PNG, False
        with _sigint_held():  # on a failure, the old pair is put back
            old_png = _temp(out, "old-png") if os.path.lexists(png) else None
            if old_png is not None:
                os.replace(png, old_png)
            try:
                if made_png:
                    os.replace(png_tmp, png)
                    placed = True
                os.replace(json_tmp, out / BENCH_JSON)
            except BaseException:
                if placed:
                    png.unlink()
                if old_png is not None:
                    os.replace(old_png, png)
                raise
            if old_png is not None:
                old_png.unlink()
    except OSError as exc:
        msg = (f"could not write bench.json and bench.png into {shown(str(out))} ({exc.strerror or exc}); the folder "
               "keeps its previous pair; free some space or give another --out (the table above has the results)")
        raise OutputWriteError(msg) from None
    finally:
        for p in (json_tmp, png_tmp):
            with contextlib.suppress(OSError):
                p.unlink()
    return [out / BENCH_JSON, *([out / BENCH_PNG] if made_png else [])]
