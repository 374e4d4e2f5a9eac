"""Inside SGLang: the graph memory of the whole schedule, forecast from the session's first capture
and logged (``SGLANG_BCG_FORECAST=1``: docs/sglang.md#graph-memory-forecast-in-the-log)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .._words import parse_bool_env
from ..accounting import device_free_bytes
from ..forecast.allocator import MB, expandable_segments
from ..forecast.driver import DriverShare, ProbeCount, counting_captures, probe_driver_share
from ..forecast.model import MODES, buffer_bytes, forecast_modes
from ..forecast.probe import device_trace, finish_modes, pool_segments, record_history, reserved_bytes
from ..forecast.trace import KeyTrace, ScaledTrace, inside, output_allocs, pool_trace
from .compat import ENV_FORECAST, ENV_FORECAST_TRACE
from .incremental import pending_sizes

log = logging.getLogger("sglang_bcg_plugin")


def measuring_forecast(environ: Mapping[str, str] | None = None) -> bool:
    """Whether a session here measures device memory for the forecast's log lines (on, on CUDA)."""
    return torch.cuda.is_available() and forecast_enabled(os.environ if environ is None else environ)


def forecast_enabled(environ: Mapping[str, str]) -> bool:
    """Whether ``SGLANG_BCG_FORECAST`` asks for the forecast lines (:raises ValueError: not a boolean)."""
    return bool(parse_bool_env(ENV_FORECAST, environ))


def schedule_sizes(cuda_graph_runner: object) -> list[int] | None:
    """The runner's capture sizes, largest first (``None``: none found)."""
    for name in ("capture_num_tokens", "capture_bs"):
        sizes = getattr(cuda_graph_runner, name, None)
        if isinstance(sizes, Sequence) and sizes and all(isinstance(s, int) and s > 0 for s in sizes):
            return sorted(set(sizes), reverse=True)
    return None


def kv_bytes_per_token(cuda_graph_runner: object) -> int | None:
    """Bytes of KV cache per token (the KV pool's bytes over its tokens; ``None``: unknown)."""
    runner = getattr(cuda_graph_runner, "model_runner", None)
    tokens = getattr(runner, "max_total_num_tokens", None)
    total = 0
    with contextlib.suppress(Exception):  # any pool kind: no figure rather than no log line
        sizes = runner.token_to_kv_pool.get_kv_size_bytes()  # type: ignore[union-attr]
        total = sum(int(s) for s in (sizes if isinstance(sizes, tuple | list) else (sizes,)))
    return total // tokens if isinstance(tokens, int) and tokens > 0 and total > 0 else None


def format_forecast(modes: Mapping[str, Any], mode: str, sizes: Sequence[int], kv_per_token: int | None,
                    driver: str = "", caveat: str = "") -> str:
    """The log line: the configured mode's forecast, what it frees against the others, its parts (``driver``:
    the description of the driver's share), ``caveat``."""
    f = modes[mode]
    deltas = {m: modes[m].total_bytes - f.total_bytes for m in MODES if m != mode}
    parts = [f"against {m} ({modes[m].total_bytes / MB:,.1f} MiB) it {'frees' if d >= 0 else 'costs'} "
             f"{abs(d) / MB:,.1f} MiB" + (f" = {d // kv_per_token:,} KV tokens" if kv_per_token and d > 0 else "")
             for m, d in deltas.items()]
    per_token = f"; KV cache {kv_per_token / 1024:,.1f} KiB/token" if kv_per_token else ""
    split = "" if f.total_bytes == f.pool_bytes else (
        f"; of which graph pool {f.pool_bytes / MB:,.1f} MiB, capture stream {f.stream_bytes / MB:,.1f} MiB, "
        f"CUDA driver {f.driver_bytes / MB:,.1f} MiB" + (f" ({driver})" if driver else ""))
    return (f"sglang_bcg: graph memory forecast for {len(sizes)} sizes up to {sizes[0]}: "
            f"{f.total_bytes / MB:,.1f} MiB with --enable-bcg-shared-output={mode}; " + "; ".join(parts) + per_token
            + split + (f" (caveat: {caveat})" if caveat else ""))


def _read(read: Callable[..., int], **kwargs: Any) -> int | None:
    """``read(**kwargs)``, ``None`` where it raises: no figure rather than no log line."""
    with contextlib.suppress(Exception):
        return read(**kwargs)
    return None


def outputs_kept(trace: KeyTrace, output_bytes: Sequence[int]) -> tuple[KeyTrace, frozenset[int]]:
    """The first capture's trace with its output held to the end (the session's policy freed it
    inside the recording), and the indices of the output allocs (the match: docs/sglang.md)."""
    freed_at = {i: pos for pos, (kind, i) in enumerate(trace.ops) if kind == 1}
    last_alloc = max((pos for pos, (kind, _) in enumerate(trace.ops) if kind == 0), default=-1)
    late = sorted((i for i, at in freed_at.items() if at > last_alloc), key=lambda i: -freed_at[i])
    found = output_allocs(trace, output_bytes, (*trace.kept, *late))
    if not found:
        return trace, frozenset(trace.kept)
    drop = {freed_at[i] for i in found if i in freed_at}
    left = [(pos, op) for pos, op in enumerate(trace.ops) if pos not in drop]
    index = {pos: new for new, (pos, (kind, _)) in enumerate(left) if kind == 0}
    ops = tuple((0, value) if kind == 0 else (1, index[value]) for _, (kind, value) in left)
    return KeyTrace(trace.size, ops), frozenset(index[i] for i in found)


#: The interpreter's thread switch interval (seconds) while the forecast is modelled on its thread (Python's default
#: is 5 ms: a thread that gave up the GIL for a device call would wait that long to take it back).
THREAD_SWITCH_S = 0.0005


class SessionForecast:
    """One capture session's forecast: :meth:`first_capture` around each ``capture_one``, :meth:`key_done` after it,
    :meth:`close` at the session's end; ``pool`` returns SGLang's graph pool handle (its session sets it).

    With sizes still pending after the first capture (incremental capture, :mod:`.incremental`), the forecast waits:
    its modelling (a second or more of pure Python over the recorded requests) would otherwise hold the first
    answer, or a capture step under load; made on a thread beside the steps, it held them for the GIL and made their
    garbage collections walk its objects (a 0.2 s decode step took 3.4-3.7 s on an H100 host). :meth:`close`, after
    the last size, measures the pool and hands the modelling and both lines to a thread of its own
    (:meth:`in_background`); :attr:`forecast` waits for that thread, or makes it at once where nothing started it
    (the memory plan, before serving; a live switch's memory check)."""

    def __init__(self, cuda_graph_runner: object, mode: str, pool: Callable[[], Any],
                 environ: Mapping[str, str] | None = None, buffer_source: str = "reserve",
                 free_at_build: int | None = None) -> None:
        env = os.environ if environ is None else environ
        self.runner, self.mode, self.pool, self.buffer_source = cuda_graph_runner, mode, pool, buffer_source
        self.sizes, self.enabled = schedule_sizes(cuda_graph_runner), forecast_enabled(env)
        self.done, self.held_at_start = False, 0
        self._made: dict[str, Any] | None = None
        self._thread: threading.Thread | None = None  #: the forecast made while serving (incremental capture)
        #: the forecast's arguments, while it waits for :meth:`in_background` or :attr:`forecast`
        self._unmade: tuple[tuple[Any, ...], int | None] | None = None
        #: what :meth:`close` measured, for the thread to log beside the forecast (``None``: not closed on a thread)
        self._closing: tuple[int, int, int | None] | None = None
        self.measured: int | None = None  # what close() found in the pool (+ a reserved buffer)
        self.lost: int | None = None  # the free device memory the session gave up (close())
        self.free_at_open = _read(device_free_bytes, collect=False) if measuring_forecast(env) else None
        self.reserved_at_open = _read(reserved_bytes) if self.free_at_open is not None else None
        self.driver: DriverShare | None = None  # the driver's share of the forecast (first capture)
        self.first_capture_driver: int | None = None  # what the first capture lost beyond the allocator
        #: free device memory when the backend was built (its ``__init__``, inside SGLang's runner,
        #: measured as SGLang measures: after ``empty_cache``), the baseline of the lost-memory line
        self.baseline = free_at_build if self.free_at_open is not None else None
        self.trace_path = env.get(ENV_FORECAST_TRACE) if self.free_at_open is not None else None
        self.rows: list[dict[str, Any]] = []
        #: what :meth:`first_capture` recorded of the first capture, for :meth:`key_done` to forecast from
        self.recorded: tuple[Any, ...] | None = None

    @property
    def forecast(self) -> dict[str, Any] | None:
        """The forecast's ``modes`` and ``references`` (``None``: none made); one made while serving is waited for."""
        thread, unmade = self._thread, self._unmade
        if thread is not None:
            thread.join()
            self._thread = None
        elif unmade is not None:
            self._unmade = None
            self._forecast_logged(*unmade[0], kv_per_token=unmade[1])
        return self._made

    @property
    def ready(self) -> dict[str, Any] | None:
        """:attr:`forecast` where it is made already; ``None`` while its thread runs or it waits to be made."""
        if self._unmade is not None or (self._thread is not None and self._thread.is_alive()):
            return None
        return self._made

    def key_done(self, size: int, graphs: int, output_bytes: list[int]) -> None:
        """After one size's capture (``output_bytes``: its output's storage bytes): after the first, the
        forecast logged (with sizes pending, later: the class's doc); with ``SGLANG_BCG_FORECAST_TRACE`` set, what
        the device holds."""
        if self.recorded is not None:
            events, segments, count, first = self.recorded
            self.recorded = None
            args = (size, events, segments, output_bytes, ProbeCount.of(size, count), first)
            kv_per_token = kv_bytes_per_token(self.runner)  # read here: the thread reads nothing of SGLang's
            if pending_sizes(self.runner):
                self._unmade = (args, kv_per_token)
            else:
                self._forecast(*args, kv_per_token=kv_per_token)
        if self.trace_path:
            self.rows.append({"size": size, "graphs": graphs, "free": _read(device_free_bytes, collect=False),
                              "reserved": torch.cuda.memory_reserved(), "pool": self._pool_bytes(),
                              "events": len(device_trace())})

    def skip_reason(self) -> str | None:
        """Why no forecast is made (``None``: one is)."""
        checks = ((lambda: self.enabled, f"{ENV_FORECAST} is not 1"), (torch.cuda.is_available, "no CUDA"),
                  (lambda: len(self.sizes or ()) >= 2, "the runner names no schedule of two sizes or more"),
                  (lambda: not device_trace(), "the allocator's history is already being recorded"))
        return next((why for holds, why in checks if not holds()), None)

    @contextlib.contextmanager
    def first_capture(self) -> Iterator[None]:
        """Record the first capture's allocator events (later calls pass through), for :meth:`key_done`."""
        why, self.done = "" if self.done else self.skip_reason(), True
        if why is not None:  # "": a later capture, passed through
            if why:
                log.debug("sglang_bcg: no graph memory forecast: %s", why)
            yield
            return
        self.held_at_start = self._pool_bytes()
        record_history(True)
        try:
            with counting_captures() as count:
                yield
            events, segments = device_trace(), self._pool_segments()
        finally:
            if not self.trace_path:  # with a trace asked for, every capture's events (close() stops)
                record_history(False)
        self.recorded = (events, segments, count, self._first_memory(segments))

    def _first_memory(self, segments: list[tuple[int, int]]) -> tuple[int, int] | None:
        """What the allocator reserved outside the pool since the session opened, and the free
        device memory lost beyond its growth (the driver's share); ``None`` where not measured."""
        free, reserved = _read(device_free_bytes, collect=False), _read(reserved_bytes)
        if None in (free, reserved, self.free_at_open, self.reserved_at_open):
            return None
        grown = reserved - self.reserved_at_open  # type: ignore[operator]
        outside = max(0, grown - (sum(n for _, n in segments) - self.held_at_start))
        return outside, max(0, self.free_at_open - free - grown)  # type: ignore[operator]

    def _pool_segments(self) -> list[tuple[int, int]]:
        pool = tuple(handle) if isinstance(handle := self.pool(), tuple | list) else None
        return [(addr, n) for p, addr, n in pool_segments() if pool in (None, p)]

    def _pool_bytes(self) -> int:
        return sum(n for _, n in self._pool_segments())

    def in_background(self) -> None:
        """Make a waiting forecast on a thread of its own (nothing to do: none waits, or one is being made)."""
        if self._unmade is None or self._thread is not None:
            return
        args, kv_per_token = self._unmade
        self._unmade = None
        self._thread = threading.Thread(target=self._on_thread, args=args, kwargs={"kv_per_token": kv_per_token},
                                        daemon=True, name="sglang-bcg-forecast")
        self._thread.start()

    def _on_thread(self, *args: Any, **kwargs: Any) -> None:
        """The thread's work: the forecast, then the after-capture lines where :meth:`close` handed them over. The
        interpreter switches threads every :data:`THREAD_SWITCH_S` meanwhile, so the scheduler, whose device calls
        give up the GIL, waits at most that long to take it back (restored after)."""
        interval = sys.getswitchinterval()
        sys.setswitchinterval(min(interval, THREAD_SWITCH_S))
        try:
            self._forecast_logged(*args, **kwargs)
            if self._closing is not None and self._made is not None:
                self._log_after(*self._closing)
        finally:
            sys.setswitchinterval(interval)

    def _forecast_logged(self, *args: Any, **kwargs: Any) -> None:
        """:meth:`_forecast` made later (on its thread, or when asked for): a failure is logged, and leaves no
        forecast (the server serves on)."""
        try:
            self._forecast(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - a thread's failure has no caller to reach
            log.warning("sglang_bcg: no graph memory forecast: %s: %s", type(exc).__name__, exc)

    def _forecast(self, size: int, events: Any, segments: list[tuple[int, int]], output_bytes: list[int],
                  graphs: Any = None, first: tuple[int, int] | None = None, kv_per_token: int | None = None) -> None:
        """``graphs``: the first capture's ``ProbeCount`` (``None``: no driver's share); ``first``:
        :meth:`_first_memory` (``None``: no stream bytes, no first-capture cost); ``kv_per_token``: the KV cache's
        bytes per token, for the line."""
        assert self.sizes is not None
        trace = pool_trace(size, events, segments)
        if not trace.ops:
            log.debug("sglang_bcg: no graph memory forecast: the first capture made no request to the pool")
            return
        trace, outputs = outputs_kept(trace, output_bytes)
        fitted, expandable = ScaledTrace.proportional(trace), expandable_segments()
        outside, self.first_capture_driver = first if first is not None else (0, None)
        self.driver = None if graphs is None else probe_driver_share(
            [graphs], self.first_capture_driver or 0, self.sizes, len(output_bytes))
        # the stream: what the first capture reserved outside the pool, less a reserved shared buffer (modelled)
        reserved = self.mode == "on" and self.buffer_source == "reserve"
        stream = max(0, outside - (buffer_bytes(sum(output_bytes), expandable) if reserved else 0))
        modes = forecast_modes(fitted, self.sizes, outputs=outputs, largest_output_bytes=sum(output_bytes),
                               expandable=expandable, stream_bytes=stream, driver=self.driver)
        modes, references, caveat = finish_modes(modes, fitted, self.sizes, outputs=outputs, expandable=expandable,
                                                 driver=self.driver, counted="in the first capture")
        described = "" if self.driver is None else self.driver.describe()
        log.info("%s", format_forecast(modes, self.mode, self.sizes, kv_per_token, described, caveat))
        self._made = {"modes": modes, "references": references}

    def close(self, outside_pool_bytes: int = 0) -> int | None:
        """Log what the session added to the pool (+ ``outside_pool_bytes``, a reserved buffer)
        beside the forecast; those bytes (``None``: no forecast)."""
        if self._unmade is not None and not self.trace_path:  # modelled now, on a thread, with both lines
            self._closing = self._measure(outside_pool_bytes)
            self.in_background()
            return self.measured
        if self.forecast is None:
            if self.trace_path and self.done:
                record_history(False)
            return None
        added, outside, free_now = self._measure(outside_pool_bytes)
        self._log_after(added, outside, free_now)
        if not self.trace_path:
            return self.measured
        return self._write_trace(self.trace_path, free_now)

    def _measure(self, outside_pool_bytes: int) -> tuple[int, int, int | None]:
        """What the session added to the pool, the bytes outside it, and the free device memory now (``measured``
        and ``lost`` set)."""
        added = self._pool_bytes() - self.held_at_start
        self.measured = added + outside_pool_bytes
        free_now = _read(device_free_bytes, collect=False)
        if self.free_at_open is not None and free_now is not None:
            self.lost = self.free_at_open - free_now
        return added, outside_pool_bytes, free_now

    def _log_after(self, added: int, outside_pool_bytes: int, free_now: int | None) -> None:
        """The after-capture lines: the session's measure beside the forecast, and the free memory lost."""
        assert self._made is not None and self.measured is not None
        measured, f = self.measured, self._made["modes"][self.mode]
        error = (f.pool_bytes - measured) / measured if measured else 0.0  # the pool and a shared buffer
        lost = "" if not self.lost else (
            f"; free device memory lost over the session {self.lost / MB:.1f} MiB, forecast with the "
            f"CUDA driver's share {f.total_bytes / MB:.1f} MiB (+ capture stream {f.stream_bytes / MB:.1f} "
            f"+ driver {f.driver_bytes / MB:.1f}), error {(f.total_bytes - self.lost) / self.lost * 100:+.1f} %")
        log.info("sglang_bcg: graph memory after capture: %.1f MiB (graph pool %.1f MiB + shared buffer %.1f MiB); "
                 "forecast %.1f MiB, error %+.1f %%%s", measured / MB, added / MB, outside_pool_bytes / MB,
                 f.pool_bytes / MB, error * 100, lost)
        if self.baseline is not None and free_now is not None:
            log.info("sglang_bcg: free device memory lost since the prefill backend was built %.1f MiB "
                     "(%.1f MiB before the first capture)", (self.baseline - free_now) / MB,
                     (self.baseline - (self.free_at_open or 0)) / MB)

    def _write_trace(self, path: str, free_now: int | None) -> int | None:
        """``SGLANG_BCG_FORECAST_TRACE``'s file, ``path``; the session's measure."""
        assert self.forecast is not None
        measured = self.measured
        # the session's record for SGLANG_BCG_FORECAST_TRACE: its rows, forecast and the ``(index, action,
        # address, bytes, stream)`` of every event in the pool's address ranges
        events, modes = device_trace(), self.forecast["modes"]
        record_history(False)
        segments = self._pool_segments()
        record = {"mode": self.mode, "sizes": self.sizes, "baseline": self.baseline, "free_at_open": self.free_at_open,
                  "free_at_close": free_now, "held_at_start": self.held_at_start, "rows": self.rows,
                  "forecast": {m: x.total_bytes for m, x in modes.items()},
                  "forecast_parts": {m: x.to_dict() for m, x in modes.items()},
                  "driver": None if self.driver is None else self.driver.to_dict(),
                  "first_capture_driver": self.first_capture_driver, "segments": segments,
                  "events": [(i, e["action"], int(e["addr"]), int(e["size"]), int(e.get("stream", 0)))
                             for i, e in enumerate(events) if inside(int(e["addr"]), segments)]}
        try:
            Path(path).write_text(json.dumps(record), encoding="utf-8")
        except OSError as exc:
            log.warning("sglang_bcg: could not write %s=%s: %s", ENV_FORECAST_TRACE, path, exc)
        return measured
