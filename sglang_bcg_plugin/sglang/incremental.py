"""Incremental capture (``SGLANG_BCG_INCREMENTAL_CAPTURE=1``, docs/sglang.md#incremental-capture): the server
captures its largest prefill size before it serves and the others between batches, largest first; a batch
whose size has no graph yet runs eagerly. The decode graphs stay as SGLang captures them.

Four hooks on SGLang's prefill runner and scheduler: the runner's ``capture`` at start-up runs without the two
full collections of SGLang's ``freeze_gc``; its capture pass (``_capture_one_stream``) captures only the sizes
this module hands it; its ``can_run_graph`` says no for a size not captured yet; the
scheduler's ``get_next_batch_to_run`` first captures the next size when every TP rank agrees it is time: the
server has served, from its first batch after the last capture, as long as that capture took, or has seen no
request for that long (a gap between batches is not idle), so a request waits for one capture at most."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from .._words import parse_bool_env
from ..errors import one_line
from .compat import sglang_source, tp_agree
from .serving_capture import light_gc, per_request_state, runner_classes, while_serving

log = logging.getLogger("sglang_bcg_plugin")

ENV_INCREMENTAL = "SGLANG_BCG_INCREMENTAL_CAPTURE"
RUNNER_CLASS = "sglang.srt.model_executor.runner.prefill_cuda_graph_runner.PrefillCudaGraphRunner"
CAPTURE_TARGET = f"{RUNNER_CLASS}._capture_one_stream"
START_TARGET = f"{RUNNER_CLASS}.capture"
CAN_RUN_TARGET = f"{RUNNER_CLASS}.can_run_graph"
STEP_TARGET = "sglang.srt.managers.scheduler.Scheduler.get_next_batch_to_run"
#: The runner's attribute holding its :class:`Pending`.
STATE_ATTR = "_bcg_incremental"
#: Seconds an idle server's step may capture for, when one size takes less (a request arriving meanwhile waits at
#: most that long, or one size's capture).
IDLE_STEP_S = 0.5
#: Set while a live switch captures (:func:`switching`).
_SWITCHING = False


def incremental_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``SGLANG_BCG_INCREMENTAL_CAPTURE`` asks for it (:raises ValueError: not a boolean)."""
    return bool(parse_bool_env(ENV_INCREMENTAL, os.environ if environ is None else environ))


def asked() -> bool:
    """:func:`incremental_enabled`, an unreadable value read as no (the flag's check names it at launch)."""
    with contextlib.suppress(ValueError):
        return incremental_enabled()
    return False


def has_runner_seam() -> bool:
    """Whether the installed SGLang's prefill runner has the capture pass and check hooked here
    (``PrefillCudaGraphRunner``, 0.5.14-0.5.23), read from its source unimported."""
    source = sglang_source(RUNNER_CLASS.rpartition(".")[0])
    text = source.read_text() if source is not None else ""
    return all(f"def {name}(" in text for name in ("_capture_one_stream", "can_run_graph", "capture"))


def wanted() -> bool:
    """Whether this process registers the hooks: asked, and the release's prefill runner has the seam."""
    return asked() and has_runner_seam()


@dataclass
class Pending:
    """The sizes of one prefill runner still to capture (largest first) and the pace of their capture."""

    sizes: list[int]
    total: int
    started: float = field(default_factory=time.perf_counter)
    current: list[int] | None = None  #: the sizes the running step captures
    last_seconds: float = 0.0  #: how long the last step took
    last_count: int = 0  #: how many sizes it captured
    last_end: float = 0.0
    slowest: float = 0.0  #: the longest a step took per size (seconds)
    failed: str | None = None  #: why the capture stopped (the rest stay eager)
    #: a live switch's decode graphs, captured by the step after its largest prefill size (until then decode runs
    #: eagerly)
    decode: Callable[[], Any] | None = None
    last_busy: float = 0.0  #: when a scheduler iteration last had requests (running or waiting)
    serving_since: float | None = None  #: the scheduler's first iteration seen (``None``: not serving yet)
    served_from: float | None = None  #: the first iteration with requests since the last step (``None``: none yet)
    by_switch: bool = False  #: the sizes are a live switch's (not start-up's): another switch waits for them

    def note(self, idle: bool, now: float) -> None:
        """A scheduler iteration at ``now``, with requests or ``idle``."""
        if not idle:
            self.last_busy = now
            if self.served_from is None:
                self.served_from = now

    def decode_next(self) -> bool:
        """Whether a live switch's decode graphs come next: after its largest prefill size (the order of a fresh
        start-up, whose graph pool it then matches), or once a prefill step failed."""
        return self.decode is not None and (self.failed is not None or len(self.sizes) < self.total)

    def wanted(self, idle: bool, now: float) -> int:
        """How many sizes this rank wants to capture now (the decode graphs count as one). With requests: one,
        once the server has served, from the first batch after the last step, as long as that step took. Idle:
        once no request has been seen for as long as the last step took (a gap between batches is not idle), as
        many as that step's pace fits in :data:`IDLE_STEP_S`, at least one. 0: none."""
        if not self.decode_next() and (not self.sizes or self.failed is not None):
            return 0
        if not idle:
            return int(self.served_from is not None and now - self.served_from >= self.last_seconds)
        if now - self.last_busy < self.last_seconds:
            return 0
        per_size = self.last_seconds / self.last_count if self.last_count else 0.0
        fits = int(IDLE_STEP_S / per_size) if per_size > 0 else 1
        return max(1, min(fits, len(self.sizes)))

    def busy(self) -> bool:
        """Whether a live switch's captures are still to come (a failed step ends its prefill sizes, not its decode
        graphs)."""
        return self.by_switch and (self.decode is not None or (bool(self.sizes) and self.failed is None))

    def progress(self) -> str:
        """``12 of 50 prefill sizes captured, the decode graphs pending``."""
        decode = ", the decode graphs pending" if self.decode is not None else ""
        return f"{self.total - len(self.sizes)} of {self.total} prefill sizes captured{decode}"

    def describe(self) -> dict[str, Any]:
        return {"captured": self.total - len(self.sizes), "sizes": self.total, "pending_sizes": list(self.sizes),
                "decode_pending": self.decode is not None, "by_switch": self.by_switch,
                "slowest_step_per_size_s": round(self.slowest, 4),
                "capture_failed": self.failed}


def pending(runner: Any) -> Pending | None:
    """The runner's incremental state (``None``: it captured everything at once)."""
    return getattr(runner, "__dict__", {}).get(STATE_ATTR)


def switch_running(runner: Any, now: Callable[[], float] = time.perf_counter) -> str | None:
    """Why another live switch must wait, in words: the last one's captures are still to come between batches
    (``None``: every size captured, a failed step left the rest eager, or the sizes pending are start-up's)."""
    state = pending(runner)
    if state is None or not state.busy():
        return None
    return f"its graphs are being captured between batches ({state.progress()}; {now() - state.started:.0f} s so far)"


def defer_decode(runner: Any, capture: Callable[[], Any]) -> bool:
    """Leave a live switch's decode capture (``capture``) to the incremental runner's first step; ``False``
    (nothing deferred): the runner captures everything at once, or nothing is pending."""
    state = pending(runner)
    if state is None or not state.sizes:
        return False
    state.decode = capture
    return True


def pending_sizes(runner: Any) -> list[int]:
    """The sizes the runner has yet to capture, beyond those the running step captures (empty: all captured, or
    being captured in the last step, or not incremental); after a failed step, the sizes left eager."""
    state = pending(runner)
    if state is None:
        return []
    now = state.current or ()
    return [n for n in state.sizes if n not in now]


@contextlib.contextmanager
def only(runner: Any, sizes: list[int]) -> Iterator[None]:
    """The runner's capture pass sees ``sizes`` alone (its ``capture_num_tokens``, restored after)."""
    every = runner.capture_num_tokens
    runner.capture_num_tokens = sorted(sizes)
    try:
        yield
    finally:
        runner.capture_num_tokens = every


def around_capture(original_fn: Callable[..., Any], runner: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of the runner's ``capture``: a start-up capture that leaves sizes for later runs SGLang's
    ``freeze_gc`` without its two full collections (:func:`.serving_capture.light_gc`), as the steps do: each walks
    every object of the scheduler's process before the server serves, and neither changes the graphs' memory (the
    graph pool is private; nothing empties the cache between). Steps and a live switch already run so; every
    other capture is SGLang's own."""
    start_up = pending(runner) is None and not _SWITCHING and asked()
    if start_up and len(set(runner.capture_num_tokens)) >= 2 and per_request_state(
            getattr(runner, "model_runner", None)) is None:  # sizes left for later (around_capture_one_stream)
        with light_gc(runner, *runner_classes()):  # the runner's module and SGLang's (a subclass elsewhere)
            return original_fn(runner, *args, **kwargs)
    return original_fn(runner, *args, **kwargs)


def around_capture_one_stream(original_fn: Callable[..., Any], runner: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of the runner's capture pass: at start-up the largest size alone, the others left pending; in a
    live switch's new runner (:func:`switching`) none; in a step, the sizes the step chose."""
    state = pending(runner)
    if state is not None and state.current is not None:
        with only(runner, state.current):
            return original_fn(runner, *args, **kwargs)
    sizes = sorted(set(runner.capture_num_tokens), reverse=True)
    if not asked() or len(sizes) < (1 if _SWITCHING else 2):
        return original_fn(runner, *args, **kwargs)
    if (kept := per_request_state(getattr(runner, "model_runner", None))) is not None:
        log.warning("sglang_bcg: incremental capture is off for this model: it keeps %s, which a capture while "
                    "serving would overwrite for requests in flight; every prefill size is captured now", kept)
        return original_fn(runner, *args, **kwargs)
    first = [] if _SWITCHING else sizes[:1]  # a live switch captures none: the largest comes in a step
    state = runner.__dict__[STATE_ATTR] = Pending(sizes[len(first):], total=len(sizes), by_switch=_SWITCHING)
    with only(runner, first):
        result = original_fn(runner, *args, **kwargs)
    state.last_end = state.last_busy = time.perf_counter()  # the first step is paced by this capture: served (or
    state.last_count, state.last_seconds = 1, state.last_end - state.started  # idle) as long
    state.slowest = state.last_seconds if first else 0.0
    if first:
        log.info("sglang_bcg: incremental capture: the largest prefill size (%d tokens) captured in %.2f s%s; %d more "
                 "between batches, largest first; until then their batches run eagerly", sizes[0], state.last_seconds,
                 phases(runner), len(sizes) - 1)
    else:
        log.info("sglang_bcg: incremental capture: %d prefill sizes to capture between batches, largest first "
                 "(%d tokens); until then their batches run eagerly", len(sizes), sizes[0])
    return result


def phases(runner: Any) -> str:
    """The last capture's phases as the backend timed them (`` (warm-ups 1.20 s, ...)``; ``""``: not timed)."""
    timed = getattr(getattr(runner, "backend", None), "__dict__", {}).get("_bcg_last_phases")
    if not isinstance(timed, dict) or not timed:
        return ""
    names = {"warmups": "warm-ups"}
    return " (" + ", ".join(f"{names.get(k, k)} {s:.2f} s" for k, s in timed.items()) + ")"


@contextlib.contextmanager
def switching() -> Iterator[None]:
    """A live switch's capture: the new prefill runner captures no size before the switch answers (the largest
    comes in the first step, the decode graphs in the next), so no request waits for more than one step."""
    global _SWITCHING
    _SWITCHING = True
    try:
        yield
    finally:
        _SWITCHING = False


def paced_from(runner: Any, start: float, now: Callable[[], float] = time.perf_counter) -> None:
    """The first step after a live switch that began at ``start`` waits until the server has served (or been idle)
    as long as the switch stopped it."""
    state = pending(runner)
    if state is not None and state.total - len(state.sizes) == 0:
        state.last_end = state.last_busy = now()
        state.last_seconds, state.last_count, state.served_from = state.last_end - start, 1, None


def around_can_run_graph(original_fn: Callable[..., Any], runner: Any, forward_batch: Any, *args: Any,
                         **kwargs: Any) -> Any:
    """AROUND hook of the runner's ``can_run_graph``: no for a batch whose bucket is not captured yet."""
    ok = original_fn(runner, forward_batch, *args, **kwargs)
    state = pending(runner)  # on every prefill batch: read in place, no copy
    if not ok or state is None or not state.sizes:
        return ok
    return runner._pad_to_bucket(len(forward_batch.input_ids), runner.capture_num_tokens) not in state.sizes


def _idle(scheduler: Any) -> bool:
    running = getattr(scheduler, "running_batch", None)
    empty = getattr(running, "is_empty", None)
    return (running is None or (callable(empty) and bool(empty()))) and not getattr(scheduler, "waiting_queue", None)


def step(scheduler: Any, now: Callable[[], float] = time.perf_counter) -> list[int] | None:
    """Capture the next pending prefill sizes of this scheduler's runner, as many as every rank agrees are due
    (after a live switch, its decode graphs in the step after its largest size, alone); the sizes captured
    (``None``: none, ``[]``: the decode graphs)."""
    runner = getattr(getattr(getattr(scheduler, "tp_worker", None), "model_runner", None),
                     "prefill_cuda_graph_runner", None)
    state = pending(runner)
    if runner is None or state is None:
        return None
    start, idle = now(), _idle(scheduler)
    if state.serving_since is None:  # serving begins: the first step is paced from here, not from the capture's end
        state.serving_since = start
        state.last_busy = max(state.last_busy, start)
    state.note(idle, start)
    count = tp_agree(state.wanted(idle, start), largest=False)  # the fewest any rank wants
    if count <= 0:
        return None
    decode = state.decode if state.decode_next() else None
    sizes = [] if decode is not None else state.sizes[:count]
    state.current = sizes
    backend = getattr(runner, "backend", None)
    try:
        if backend is not None:
            backend._bcg_resume = True
        with while_serving(runner):  # no batch in flight, requests keep their KV, no full collection per step
            if decode is not None:
                decode()
            else:
                runner.capture()
    except Exception as exc:  # the server keeps serving: the rest of the sizes run eagerly
        state.failed = f"{type(exc).__name__}: {one_line(exc)}"
        if decode is not None:  # the decode graphs stay eager too: not tried again
            state.decode = None
        log.exception("sglang_bcg: incremental capture of %s failed; %d prefill sizes stay eager",
                      f"prefill sizes {sizes}" if sizes else "the decode graphs", len(state.sizes))
        forecast_now(runner)  # no session closes now: the first capture's forecast comes on its thread
        return None
    finally:
        state.current = None
        if backend is not None:
            backend.__dict__.pop("_bcg_resume", None)
    before = state.total - len(state.sizes)
    if decode is not None:
        state.decode = None
    del state.sizes[:len(sizes)]
    state.last_end, state.last_count, state.served_from = now(), max(1, len(sizes)), None
    state.last_seconds = state.last_end - start
    state.slowest = max(state.slowest, state.last_seconds / state.last_count)
    done = state.total - len(state.sizes)
    if not sizes:
        log.info("sglang_bcg: incremental capture: the decode graphs captured in %.2f s", state.last_seconds)
    elif not state.sizes:
        log.info("sglang_bcg: incremental capture: all %d prefill sizes captured, %.1f s after the first",
                 state.total, state.last_end - state.started)
    elif done // 10 > before // 10:  # progress, every ten sizes
        log.info("sglang_bcg: incremental capture: %d of %d prefill sizes captured (down to %d tokens)",
                 done, state.total, sizes[-1])
    return sizes


def forecast_now(runner: Any) -> None:
    """Start the first capture's forecast on its thread (it waits for the session's close otherwise)."""
    in_background = getattr(getattr(getattr(runner, "backend", None), "_bcg_forecast", None), "in_background", None)
    if callable(in_background):
        in_background()


def before_next_batch(original_fn: Callable[..., Any], scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of ``Scheduler.get_next_batch_to_run``: one incremental capture step first."""
    step(scheduler)
    return original_fn(scheduler, *args, **kwargs)
