"""The backend seam (0.5.14+): our subclass of the release's ``BreakableCudaGraphBackend``, running its own
``capture_one`` with our output policy, and the resolver hooks that put it, or another registered backend, in place of
SGLang's own (docs/sglang.md#the-releases-own-capture and docs/sglang.md#routing-a-phase-to-another-backend)."""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import time
from collections.abc import Callable, Hashable, Iterator
from typing import Any

from ..accounting import device_free_bytes
from ..backends.base import CaptureBackend, check_key
from ..output.state import CaptureState, input_storages
from ..engines.gcsafe import defer_release, gc_safe_capture
from ..errors import warn_user
from ..manager import get_plugin_manager
from ..options import BackendOptions
from ..output.mode import ON
from ..registry import build_registry
from ..output.report import MemoryReport
from ..output.trees import flatten
from .compat import (BACKEND_MODULE, SGLANG_BREAKABLE, capture_one_args, capture_var, code_names, installed,
                     num_segments, run_outside_capture, runner_rows)
from .forecast_log import SessionForecast, measuring_forecast
from .incremental import pending_sizes
from .memory_plan import EAGER, not_applied, tell_once
from .sglang_session import apply_runner_rows, check_rows, drop_global_pool, open_state, runner_server_args

logger = logging.getLogger(__name__)

#: Warmups the release's ``capture_one`` runs before its capture (every release; checked at capture).
WARMUPS = 2

#: The release's output helpers our subclass overrides (SGLang makes no buffer of its own).
INTERCEPTED = ("_shared_output_buffer", "_alloc_full_buffer", "_output_rows", "_copy_output_to_buffer", "_slice_output")
#: The other private names the releases' ``capture_one`` (0.5.14-0.5.23) use: none holds an output.
NEUTRAL = ("_device_module", "_tp_group", "_precarve", "_pool", "_capture_stream", "_debug_eager",
           "_cuda_graph_runner", "_graphs", "_outputs", "_capture_inputs")


def unknown_capture_helpers(capture_one: object) -> list[str]:
    """Private names a release's ``capture_one`` uses that neither :data:`INTERCEPTED` nor
    :data:`NEUTRAL` lists (a new helper may keep an output of SGLang's own)."""
    names = code_names(capture_one)
    if names is None:
        return ["<no code>"]
    return sorted(n for n in names if n.startswith("_") and not n.startswith("__") and n not in INTERCEPTED + NEUTRAL)


class _Forward:
    """The forward and the post-warmup hook the release's ``capture_one`` gets for one key."""

    def __init__(self, backend: Any, key: Hashable, forward_fn: Callable[[], Any], hook: Callable[[], None] | None,
                 capture_inputs: Any) -> None:
        self.backend, self.key, self.forward_fn, self.hook, self.inputs = backend, key, forward_fn, hook, capture_inputs
        self.engine = importlib.import_module(BACKEND_MODULE).BreakableCUDAGraph  # its module holds the capture var
        self.warmups, self.last_warmup, self.placed, self.captured = 0, None, None, False
        self.output_bytes: list[int] = []
        self.warmed_at: float | None = None  #: when the release's post-warmup hook ran (``perf_counter``)

    def forward(self) -> Any:  # a named function: releases <= 0.5.21 log a debug break's __name__
        if self.captured:  # a debug_eager replay: the release's break reruns the forward; refresh ours
            for (_, dst), (_, src) in zip(flatten(self.placed)[1], flatten(self._rows(self.forward_fn()))[1],
                                          strict=True):
                dst.copy_(src)
            return self.placed
        if capture_var(self.engine).get() is None:  # a warmup
            self.warmups += 1
            with EAGER.measuring(getattr(self.key, "size", 0)):  # the memory plan's eager forward
                self.last_warmup = self.forward_fn()
            return self.last_warmup
        if self.warmups != WARMUPS:
            raise RuntimeError(f"SGLang {installed().release}'s capture_one ran {self.warmups} warmups, not {WARMUPS}, "
                               "before its capture")
        # the captured call (under debug_eager inside the release's one eager break: run it outside)
        out = run_outside_capture(self.engine, self.forward_fn) if self.backend._debug_eager else self.forward_fn()
        self.output_bytes.extend(t.untyped_storage().nbytes() for _, t in flatten(out)[1])
        self.placed = self.backend._bcg_state.policy.place(self.key, self._rows(out), input_storages(self.inputs))
        self.captured = True
        return self.placed

    def after_warmup(self) -> None:
        self.warmed_at = time.perf_counter()
        if self.hook is not None:
            self.hook()
        state, out, self.last_warmup = self.backend._bcg_state, self.last_warmup, None
        if self.warmups == WARMUPS and state.mode_active == ON and out is not None:
            # reserve: from the last warmup, outside the pool, in the rows handed out, grown to the capacity asked
            rows, capacity = runner_rows(self.backend._cuda_graph_runner, out)
            state.policy.reserve(self.key, apply_runner_rows(out, rows),
                                 check_rows("cuda_graph_output_capacity_rows", capacity))

    def _rows(self, out: Any) -> Any:
        return apply_runner_rows(out, runner_rows(self.backend._cuda_graph_runner, out)[0])


class SharingPolicyMixin:
    """Output policy over SGLang's BCG capture; mixed in before SGLang's class."""

    # Set by SGLang's BreakableCudaGraphBackend.__init__ (every release 0.5.14+).
    _cuda_graph_runner: Any
    _graphs: dict[Any, Any]
    _outputs: dict[Any, Any]
    _pool: Any
    _debug_eager: bool

    name = SGLANG_BREAKABLE

    def __init__(self, cuda_graph_runner: Any, *, enable_memory_saver: bool = False, debug_eager: bool = False) -> None:
        super().__init__(  # type: ignore[call-arg]
            cuda_graph_runner, enable_memory_saver=enable_memory_saver, debug_eager=debug_eager)
        self._cuda_graph_runner = cuda_graph_runner  # set by SGLang itself only from 0.5.21
        self._bcg_state = CaptureState(self.name, "sglang-bcg")
        # the forecast log's baseline, measured here at the seam (SGLang's own figure is a local of its caller)
        self._bcg_free_at_build = device_free_bytes(collect=False) if measuring_forecast() else None

    @contextlib.contextmanager
    def capture_session(self, stream: Any) -> Iterator[None]:
        """SGLang's session (pool, dedup, BCG mode) plus a freshly resolved output policy; an incremental
        capture's later sizes (``_bcg_resume``, :mod:`.incremental`) resume the first session's buffers and
        forecast, which logs its after-capture line once the last size is captured."""
        resume = bool(self.__dict__.get("_bcg_resume"))
        plan = open_state(self._bcg_state, resume=resume)
        tell_once(not_applied(getattr(self._cuda_graph_runner, "model_runner", None)))
        try:  # gc: one collection per session, not per key (docs/index.md#gc-safety)
            earlier = getattr(self, "_bcg_forecast", None)
            if not resume or earlier is None or not earlier.done:  # the first size to capture (a switch captured none)
                self._bcg_forecast = SessionForecast(self._cuda_graph_runner, plan.mode,
                                                     lambda: getattr(self, "_pool", None),
                                                     buffer_source=plan.buffer_source,
                                                     free_at_build=None if resume else self._bcg_free_at_build)
            with gc_safe_capture(collect=not resume), super().capture_session(stream):  # type: ignore[misc]
                yield
            if not pending_sizes(self._cuda_graph_runner):
                if resume:  # the KV pool may have been backed since the first size: no free-memory figure
                    self._bcg_forecast.free_at_open = self._bcg_forecast.baseline = None
                reserved = plan.mode == ON and plan.buffer_source == "reserve"
                self._bcg_forecast.close(self._bcg_state.report().resident_output_bytes if reserved else 0)
        finally:
            self._bcg_state.close()

    last_output_mode = property(lambda self: self._bcg_state.resolution,
                                doc="The output mode of the latest capture session and why "
                                    "(``None`` before the first).")
    output_mode_active = property(lambda self: self._bcg_state.mode_active,
                                  doc="The output mode of the open capture session (``None`` outside one).")

    def capture_one(self, shape_key: Any, forward_fn: Callable[[], Any], *args: Any, **kwargs: Any) -> None:
        """The release's own ``capture_one`` (its arguments under any release's names:
        :func:`.compat.capture_one_args`); the output goes through the core's policy."""
        capture_inputs, post_warmup_hook = capture_one_args(args, kwargs)
        forward = _Forward(self, shape_key, forward_fn, post_warmup_hook, capture_inputs)
        key, state = check_key(shape_key), self._bcg_state
        state.begin(key)
        forecast = self._bcg_forecast  # made when the session opened (state.begin checked it is open)
        began = time.perf_counter()
        with forecast.first_capture():
            start = time.perf_counter()
            with gc_safe_capture():
                super().capture_one(shape_key, forward.forward, capture_inputs, forward.after_warmup)  # type: ignore[misc]
            if not forward.captured:
                msg = f"SGLang {installed().release}'s capture_one did not call the forward inside its capture"
                raise RuntimeError(msg)
            if not self._debug_eager:  # released: the policy holds the last reference to the graph's output
                forward.placed = None
            graph = self._graphs[key]
            self._outputs[key] = state.commit(key, graph=graph, num_segments=num_segments(graph),
                                              capture_inputs=capture_inputs, seconds=time.perf_counter() - start)
        captured = time.perf_counter()
        forecast.key_done(key.size, num_segments(graph), forward.output_bytes)
        warmed = forward.warmed_at if forward.warmed_at is not None else began
        #: the last capture's phases (seconds): the warm-ups, the capture, what the forecast did after it
        self._bcg_last_phases = {"warmups": warmed - began, "capture": captured - warmed,
                                 "forecast": time.perf_counter() - captured}

    # -- the release's output helpers (INTERCEPTED), called by its capture_one: no buffer of SGLang's own --
    _shared_output_buffer = property(lambda self: None, lambda self, value: None)
    _alloc_full_buffer = _output_rows = _copy_output_to_buffer = _slice_output = lambda self, *args: None

    def __del__(self) -> None:  # dropped inside a capture: SGLang's graphs die after it
        defer_release(list(getattr(self, "_graphs", {}).values()))
        getattr(super(), "__del__", lambda: None)()  # SGLang's dedup mixin closes its registry

    def replay(self, shape_key: Any, static_forward_batch: Any, **kwargs: Any) -> Any:
        """SGLang's replay; with the stale-output guard on, guarded views of the output."""
        out = super().replay(shape_key, static_forward_batch, **kwargs)  # type: ignore[misc]
        return self._bcg_state.hand_out(shape_key, out, pool=self._pool)

    def memory_report(self) -> MemoryReport:
        """Logical vs resident output bytes, fallbacks and capture seconds, per key."""
        return self._bcg_state.report()

    def cleanup(self) -> None:
        """SGLang's cleanup, our records, and a usable global pool for the next session."""
        pool = self._pool
        super().cleanup()  # type: ignore[misc]
        self._bcg_state.clear()
        drop_global_pool(pool)


@functools.cache
def sglang_breakable_backend_class() -> type[Any]:
    """Our subclass of the installed ``BreakableCudaGraphBackend``, built once (imports SGLang).
    :raises RuntimeError: the installed SGLang has no backend seam (0.5.13: :mod:`.runner_seam`)."""
    seam = installed()
    if seam.kind != "backend":
        raise RuntimeError(f"{seam.describe()}: there is no BreakableCudaGraphBackend to subclass; the plugin hooks "
                           "this release's breakable graph through its runner instead")
    base = importlib.import_module(BACKEND_MODULE).BreakableCudaGraphBackend
    doc = "SGLang's breakable CUDA graphs with our output-sharing policy."
    return type("SGLangBreakableBackend", (SharingPolicyMixin, base), {"__module__": __name__, "__doc__": doc})


#: HookRegistry targets of the two AROUND hooks.
PREFILL_TARGET = "sglang.srt.model_executor.runner_backend.utils.resolve_prefill_backend"
DECODE_TARGET = "sglang.srt.model_executor.runner_backend.utils.resolve_decode_backend"
BASE_MODULE = "sglang.srt.model_executor.runner_backend.base_cuda_graph_backend"

#: Whether a select hook's deprecated ``"breakable"`` was warned about (once a process).
_warned_breakable = False


def _warn_breakable(phase: str) -> None:
    """The one ``DeprecationWarning`` of a process whose ``sglang_bcg_select_backend`` returned ``"breakable"``."""
    global _warned_breakable
    if not _warned_breakable:
        _warned_breakable = True
        msg = (f"sglang_bcg_select_backend returned 'breakable' for the {phase} phase: it still keeps SGLang's "
               f"breakable backend under the plugin's output policy, which is now named {SGLANG_BREAKABLE!r} "
               f"('breakable' is the plugin's own BreakableBackend); return {SGLANG_BREAKABLE!r}, or None, instead")
        warn_user(msg, DeprecationWarning)


def swap_backend(phase: str, backend: Any, cuda_graph_runner: Any) -> Any:
    """Replace SGLang's own breakable backend by the one ``sglang_bcg_select_backend`` picks: ours
    (``None`` or ``"sglang-breakable"``; ``"breakable"``, deprecated, too), a registered SGLang backend
    class, or ours behind the adapter."""
    if type(backend) is not importlib.import_module(BACKEND_MODULE).BreakableCudaGraphBackend:
        return backend  # Full and platform backends: SGLang's choice, unchanged
    adapter = getattr(backend, "_memory_saver_adapter", None)
    kwargs = {"enable_memory_saver": bool(getattr(adapter, "enabled", False)),
              "debug_eager": bool(getattr(backend, "_debug_eager", False))}
    close = getattr(backend, "close", None)  # the dedup mixin's (SGLang 0.5.15+)
    if close is not None:
        close()  # SGLang's instance captured nothing; drop its (empty) dedup registries
    pm = get_plugin_manager()
    name = pm.hook.sglang_bcg_select_backend(phase=phase, server_args=runner_server_args(cuda_graph_runner))
    if name == "breakable":  # the old word for ours: kept for the plugins that return it
        _warn_breakable(phase)
        name = SGLANG_BREAKABLE
    if name in (None, SGLANG_BREAKABLE):
        chosen: Any = sglang_breakable_backend_class()(cuda_graph_runner, **kwargs)
    else:
        factory = build_registry(pm).get(name)
        if isinstance(factory, type) and issubclass(factory, importlib.import_module(BASE_MODULE).BaseCudaGraphBackend):
            chosen = factory(cuda_graph_runner, **kwargs)
        else:
            ours = factory(options=BackendOptions(), plugin_manager=pm)
            chosen = sglang_adapter_class()(ours, cuda_graph_runner)
    logger.debug("sglang_bcg: %s backend %s (selected %r)", phase, type(chosen).__qualname__, name or SGLANG_BREAKABLE)
    return chosen


def around_resolve_prefill_backend(original_fn: Callable[..., Any], cuda_graph_runner: Any, *args: Any,
                                   **kwargs: Any) -> Any:
    """AROUND hook of ``resolve_prefill_backend``."""
    return swap_backend("prefill", original_fn(cuda_graph_runner, *args, **kwargs), cuda_graph_runner)


def around_resolve_decode_backend(original_fn: Callable[..., Any], cuda_graph_runner: Any, *args: Any,
                                  **kwargs: Any) -> Any:
    """AROUND hook of ``resolve_decode_backend``."""
    return swap_backend("decode", original_fn(cuda_graph_runner, *args, **kwargs), cuda_graph_runner)


class CaptureBackendAdapterMixin:
    """SGLang's six-method backend contract, forwarded to one of our :class:`CaptureBackend`."""

    def __init__(self, backend: CaptureBackend, cuda_graph_runner: object = None) -> None:
        self.backend = backend
        self._cuda_graph_runner = cuda_graph_runner

    def capture_session(self, stream: Any) -> contextlib.AbstractContextManager[None]:
        return self.backend.capture_session(stream)

    def capture_one(self, shape_key: Any, forward_fn: Callable[[], Any], *args: Any, **kwargs: Any) -> None:
        """``(capture_inputs, post_warmup_hook)`` under any release's names (``dummies`` up to 0.5.16)."""
        self.backend.capture_one(shape_key, forward_fn, *capture_one_args(args, kwargs))

    def can_run(self, forward_batch: Any, shape_key: Any) -> bool:
        return self.backend.can_run(shape_key)

    def replay_session(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def replay(self, shape_key: Any, static_forward_batch: Any, **kwargs: Any) -> Any:
        return self.backend.replay(shape_key)

    def cleanup(self) -> None:
        self.backend.cleanup()

    def memory_report(self) -> MemoryReport:
        return self.backend.memory_report()


@functools.cache
def sglang_adapter_class() -> type[Any]:
    """The adapter class: our mixin over SGLang's ``BaseCudaGraphBackend`` (built once)."""
    base = importlib.import_module(BASE_MODULE).BaseCudaGraphBackend
    return type("CaptureBackendAdapter", (CaptureBackendAdapterMixin, base),
                {"__module__": __name__, "__doc__": CaptureBackendAdapterMixin.__doc__})
