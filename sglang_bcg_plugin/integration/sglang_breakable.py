"""Our Breakable backend *inside* SGLang (0.5.14+): SGLang's own capture, our output policy.

SGLang's prefill runner checks ``isinstance(backend, BreakableCudaGraphBackend)`` in about ten
places, and model code's ``eager_on_graph`` break points talk to SGLang's own segment engine.
So the class built by :func:`sglang_breakable_backend_class` *subclasses* the installed
release's ``BreakableCudaGraphBackend``, keeps its constructor ``(cuda_graph_runner, *,
enable_memory_saver=False, debug_eager=False)``, and runs its session, ``capture_one``, replay
and cleanup: whatever the release does around a capture (warmups, barriers, pool scopes,
precarve, graph dedup, the debug form) is the release's own code.

``capture_one`` wraps the release's own: it hands SGLang a forward function and a post-warmup
hook of ours, and overrides the release's output helpers, so that

1. the warmups' outputs are seen by our forward; after the last warmup (our hook) the core's
   output policy ``reserve``\\ s the shared buffer outside the graph pool;
2. the captured call of the forward (inside SGLang's capture) goes through the policy's
   ``place`` (the in-graph copy into the shared slice); with ``debug_eager`` the release runs
   the whole forward as one eager break and our forward runs it outside the capture;
3. SGLang's own buffer is never made: ``_shared_output_buffer`` always reads ``None`` and
   ``_alloc_full_buffer`` / ``_output_rows`` / ``_copy_output_to_buffer`` / ``_slice_output``
   (:data:`INTERCEPTED`) do nothing;
4. after the release's ``capture_one`` returns, the state commits the key and its output
   replaces the one SGLang stored.

``tests/sglang/test_sglang_upstream.py`` fails when a release's ``capture_one`` uses a helper
this list does not know. ``cleanup()`` also drops SGLang's process-global pool handle when it is
ours (:func:`.sglang_session.drop_global_pool`), so a new capture session works in the same
process.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import time
from collections.abc import Callable, Hashable, Iterator
from typing import Any

from ..backends.state import CaptureState, input_storages
from ..engines.gcsafe import defer_release, gc_safe_capture
from ..output_mode import ON, OutputMode, Resolution
from ..report import MemoryReport
from ..shape_key import check_key
from ..trees import flatten
from .compat import BACKEND_CLASS, BACKEND_MODULE, capture_one_args, capture_var, installed, num_segments, run_outside_capture, runner_rows
from .forecast_log import SessionForecast
from .sglang_session import apply_runner_rows, drop_global_pool, open_state, reserve_from_warmup

__all__ = ["INTERCEPTED", "SGLANG_BCG_CLASS", "SharingPolicyMixin", "apply_runner_rows", "sglang_breakable_backend_class"]

#: Dotted path of SGLang's breakable backend class (our base class).
SGLANG_BCG_CLASS = BACKEND_CLASS

#: Warmups SGLang's ``capture_one`` runs before its capture (every release: two); the policy
#: reserves after the last one.
WARMUPS = 2

#: The release's output helpers our subclass overrides (step 3 of the module doc).
INTERCEPTED = ("_shared_output_buffer", "_alloc_full_buffer", "_output_rows", "_copy_output_to_buffer", "_slice_output")


class _Forward:
    """The forward function and post-warmup hook SGLang's ``capture_one`` gets for one key."""

    def __init__(self, backend: Any, key: Hashable, forward_fn: Callable[[], Any], hook: Callable[[], None] | None,
                 capture_inputs: Any) -> None:
        self.backend, self.key, self.forward_fn, self.hook = backend, key, forward_fn, hook
        self.capture_inputs = capture_inputs
        self.engine = importlib.import_module(BACKEND_MODULE).BreakableCUDAGraph  # its module holds the capture var
        self.var = capture_var(self.engine)
        self.warmups = 0
        self.last_warmup: Any = None
        self.placed: Any = None
        self.captured = False  # the captured call ran; later calls are debug_eager replays
        self.output_bytes: list[int] = []

    def forward(self) -> Any:  # a named function: releases <= 0.5.21 log a debug break's __name__
        backend, state = self.backend, self.backend._bcg_state
        if self.captured:  # SGLang's debug break replays the whole forward: refresh our output
            return _refresh(self.placed, self._rows(self.forward_fn()))
        if self.var.get() is None:  # a warmup
            self.warmups += 1
            self.last_warmup = self.forward_fn()
            return self.last_warmup
        if self.warmups != WARMUPS:
            msg = (f"SGLang {installed().release}'s capture_one ran {self.warmups} warmups before its capture; "
                   f"sglang_bcg reserves the shared output after warmup {WARMUPS} (a changed release: see docs/sglang.md)")
            raise RuntimeError(msg)
        # the captured call; under debug_eager it runs inside SGLang's one eager break, whose
        # own breaks must run inline
        out = run_outside_capture(self.engine, self.forward_fn) if backend._debug_eager else self.forward_fn()
        self.output_bytes.extend(t.untyped_storage().nbytes() for _, t in flatten(out)[1])
        self.placed = state.policy.place(self.key, self._rows(out), input_storages(self.capture_inputs))
        self.captured = True
        return self.placed

    def after_warmup(self) -> None:
        if self.hook is not None:
            self.hook()
        if self.warmups == WARMUPS:  # reserve: outside the graph pool, from the last warmup
            reserve_from_warmup(self.backend._bcg_state, self.key, self.backend._cuda_graph_runner, self.last_warmup)
            self.last_warmup = None

    def _rows(self, out: Any) -> Any:
        return apply_runner_rows(out, runner_rows(self.backend._cuda_graph_runner, out)[0])


def _refresh(placed: Any, fresh: Any) -> Any:
    for (_, dst), (_, src) in zip(flatten(placed)[1], flatten(fresh)[1], strict=True):
        dst.copy_(src)
    return placed


class SharingPolicyMixin:
    """Output policy over SGLang's BCG capture; mixed in before SGLang's class."""

    # Set by SGLang's BreakableCudaGraphBackend.__init__ (every release 0.5.14+).
    _cuda_graph_runner: Any
    _graphs: dict[Any, Any]
    _outputs: dict[Any, Any]
    _pool: Any
    _debug_eager: bool

    name = "breakable"

    def __init__(
        self, cuda_graph_runner: Any, *, enable_memory_saver: bool = False, debug_eager: bool = False
    ) -> None:
        super().__init__(  # type: ignore[call-arg]
            cuda_graph_runner, enable_memory_saver=enable_memory_saver, debug_eager=debug_eager
        )
        self._cuda_graph_runner = cuda_graph_runner  # set by SGLang itself only from 0.5.21
        self._bcg_state = CaptureState(self.name, "sglang-bcg")

    @contextlib.contextmanager
    def capture_session(self, stream: Any) -> Iterator[None]:
        """SGLang's session (pool, dedup, BCG mode) plus a freshly resolved output policy."""
        plan = open_state(self._bcg_state, seam=installed())
        mode = plan.mode
        self._bcg_forecast = SessionForecast(self._cuda_graph_runner, mode, lambda: getattr(self, "_pool", None))
        try:  # gc: one collection per session, not per key (docs/index.md "GC safety")
            with gc_safe_capture(), super().capture_session(stream):  # type: ignore[misc]
                yield
            reserved = mode == ON and plan.buffer_source == "reserve"
            self._bcg_forecast.close(self._bcg_state.report().resident_output_bytes if reserved else 0)
        finally:
            self._bcg_state.close()

    @property
    def last_output_mode(self) -> Resolution | None:
        """The output mode of the latest capture session and why (``None`` before the first)."""
        return self._bcg_state.resolution

    @property
    def output_mode_active(self) -> OutputMode | None:
        """The output mode of the open capture session (``None`` outside one)."""
        return self._bcg_state.mode_active

    def capture_one(self, shape_key: Any, forward_fn: Callable[[], Any], *args: Any, **kwargs: Any) -> None:
        """The release's own ``capture_one``; the output goes through the core's policy.

        Takes ``(capture_inputs, post_warmup_hook)`` under the installed release's names
        (:func:`.compat.capture_one_args`: 0.5.14-0.5.16 call the first ``dummies``)."""
        capture_inputs, post_warmup_hook = capture_one_args(args, kwargs)
        key, state = check_key(shape_key), self._bcg_state
        state.begin(key)
        forward = _Forward(self, key, forward_fn, post_warmup_hook, capture_inputs)
        forecast = getattr(self, "_bcg_forecast", None)
        with forecast.first_capture(key.size, forward.output_bytes) if forecast is not None else contextlib.nullcontext():
            start = time.perf_counter()
            with gc_safe_capture():
                super().capture_one(shape_key, forward.forward, capture_inputs, forward.after_warmup)  # type: ignore[misc]
            if not forward.captured:
                msg = f"SGLang {installed().release}'s capture_one did not call the forward inside its capture"
                raise RuntimeError(msg)
            if not self._debug_eager:  # released: the policy holds the last reference to the graph's output
                forward.placed = None
            output = state.commit(
                key, graph=self._graphs[key], num_segments=num_segments(self._graphs[key]),
                capture_inputs=capture_inputs, seconds=time.perf_counter() - start,
            )
            self._outputs[key] = output
        if forecast is not None:
            forecast.key_done(key.size, num_segments(self._graphs[key]))

    # -- the release's output helpers, called by its capture_one: no buffer of SGLang's own --
    @property
    def _shared_output_buffer(self) -> None:
        return None

    @_shared_output_buffer.setter
    def _shared_output_buffer(self, value: object) -> None:
        """SGLang's adopted (0.5.14-0.5.15) or allocated buffer: never kept."""

    def _alloc_full_buffer(self, output: Any, size: int) -> None:
        return None

    def _output_rows(self, output: Any, cap: int) -> int:
        return cap

    def _copy_output_to_buffer(self, output: Any, output_buffer: Any, num_tokens: int) -> None:
        return None

    def _slice_output(self, output: Any, num_tokens: int) -> None:
        return None  # the key's output is the committed one (capture_one)

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
    """Our breakable backend class, a subclass of the installed SGLang's ``BreakableCudaGraphBackend``.

    Built on first call (imports SGLang) and cached, so every caller gets the same class.

    :raises RuntimeError: the installed SGLang has no backend seam (0.5.13: its breakable graph is
        a runner, hooked by :mod:`.runner_seam`).
    """
    seam = installed()
    if seam.kind != "backend":
        msg = (
            f"{seam.describe()}: there is no BreakableCudaGraphBackend to subclass; "
            "the plugin hooks this release's breakable graph through its runner instead"
        )
        raise RuntimeError(msg)
    base = importlib.import_module(BACKEND_MODULE).BreakableCudaGraphBackend
    return type(
        "SGLangBreakableBackend",
        (SharingPolicyMixin, base),
        {"__module__": __name__, "__doc__": "SGLang's breakable CUDA graphs with our output-sharing policy."},
    )
