"""Our Breakable backend *inside* SGLang (0.5.14+): SGLang's BCG segment engine, our output policy.

SGLang's prefill runner checks ``isinstance(backend, BreakableCudaGraphBackend)`` in about ten
places, and model code's ``eager_on_graph`` break points talk to SGLang's own segment engine
(``BreakableCUDAGraph`` / ``BreakableCUDAGraphCapture``). So the class built by
:func:`sglang_breakable_backend_class` *subclasses* the installed release's
``BreakableCudaGraphBackend``, keeps its constructor ``(cuda_graph_runner, *,
enable_memory_saver=False, debug_eager=False)``, and reuses its session (pool, dedup
registries), replay and cleanup unchanged.

This class is a thin adapter: it translates SGLang's keys, rows, pool and warmups into the
core's :class:`~sglang_bcg_plugin.backends.state.CaptureState` (mode, output policy, guard,
per-key records, report). ``capture_one`` is SGLang's capture sequence, with each difference
between releases taken from :func:`.compat.installed` (the graph's constructor, the capture's
``barrier_fn``, ``graph_pool_capture_scope``, the precarve, the ``eager_on_graph`` form):

1. two warmups, as SGLang runs them (device sync and TP barrier before each);
2. ``reserve``: the shared buffer from the last warmup, outside the graph pool (rows from the
   runner's hooks where the release has them);
3. the segment capture; inside it the core's output policy places the output (the in-graph copy);
4. commit: the state records the key and returns the output to hand out.

``cleanup()`` also drops SGLang's process-global pool handle when it is ours
(:func:`.sglang_session.drop_global_pool`), so a new capture session works in the same process.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from ..backends.state import CaptureState, input_storages
from ..engines.gcsafe import defer_release, gc_safe_capture
from ..output_mode import ON, OutputMode, Resolution
from ..report import MemoryReport
from ..shape_key import check_key
from ..trees import flatten
from .compat import (
    BACKEND_CLASS,
    BACKEND_MODULE,
    Seam,
    capture_one_args,
    eager_break,
    installed,
    num_segments,
    run_outside_capture,
    runner_rows,
)
from .forecast_log import SessionForecast
from .sglang_session import (
    apply_runner_rows,
    drop_global_pool,
    open_state,
    reserve_from_warmup,
)

__all__ = ["SGLANG_BCG_CLASS", "SharingPolicyMixin", "apply_runner_rows", "sglang_breakable_backend_class"]

#: Dotted path of SGLang's breakable backend class (our base class).
SGLANG_BCG_CLASS = BACKEND_CLASS

#: SGLang's warmup count before each capture (every release runs two).
WARMUPS = 2


def _bcg_module() -> Any:
    # Read the segment engine's names from SGLang's backend module at call time, exactly where
    # SGLang's own capture_one reads them (patches of that module apply to both).
    return importlib.import_module(BACKEND_MODULE)


class SharingPolicyMixin:
    """Output policy over SGLang's BCG capture; mixed in before SGLang's class."""

    # Set by SGLang's BreakableCudaGraphBackend.__init__ (every release 0.5.14+).
    _cuda_graph_runner: Any
    _graphs: dict[Any, Any]
    _outputs: dict[Any, Any]
    _pool: Any
    _device_module: Any
    _tp_group: Any
    _capture_stream: Any
    _debug_eager: bool

    name = "breakable"

    def __init__(
        self, cuda_graph_runner: Any, *, enable_memory_saver: bool = False, debug_eager: bool = False
    ) -> None:
        super().__init__(  # type: ignore[call-arg]
            cuda_graph_runner, enable_memory_saver=enable_memory_saver, debug_eager=debug_eager
        )
        self._cuda_graph_runner = cuda_graph_runner  # set by SGLang itself only from 0.5.21
        self._seam: Seam = installed()
        self._bcg_state = CaptureState(self.name, "sglang-bcg")

    @contextlib.contextmanager
    def capture_session(self, stream: Any) -> Iterator[None]:
        """SGLang's session (pool, dedup, BCG mode) plus a freshly resolved output policy."""
        plan = open_state(self._bcg_state, seam=self._seam)
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

    def _warmups(self, key: Any, forward_fn: Callable[[], Any], post_warmup_hook: Callable[[], None] | None) -> Any:
        precarve = getattr(self, "_precarve", None) if self._seam.precarve else None
        out = None
        for _ in range(WARMUPS):  # as SGLang does, so lazy kernels settle first
            self._device_module.synchronize()
            self._tp_group.barrier()
            with precarve.measure() if precarve is not None else contextlib.nullcontext():
                out = forward_fn()
            if post_warmup_hook is not None:
                post_warmup_hook()
        return out

    def _capture_context(self, mod: Any, graph: Any) -> contextlib.ExitStack:
        seam, stack = self._seam, contextlib.ExitStack()
        if seam.pool_capture_scope:
            stack.enter_context(mod.graph_pool_capture_scope())
        kwargs = {"barrier_fn": self._tp_group.barrier} if seam.barrier_fn else {}
        stack.enter_context(
            mod.BreakableCUDAGraphCapture(cuda_graph=graph, pool=self._pool, stream=self._capture_stream, **kwargs)
        )
        return stack

    def capture_one(self, shape_key: Any, forward_fn: Callable[[], Any], *args: Any, **kwargs: Any) -> None:
        """SGLang's warmups and segment capture; the output goes through the core's policy.

        Takes ``(capture_inputs, post_warmup_hook)`` under the installed release's names
        (:func:`.compat.capture_one_args`: 0.5.14-0.5.16 call the first ``dummies``)."""
        capture_inputs, post_warmup_hook = capture_one_args(args, kwargs)
        key, state = check_key(shape_key), self._bcg_state
        output_bytes: list[int] = []  # the first capture's output storages, for the forecast
        forecast = getattr(self, "_bcg_forecast", None)
        with forecast.first_capture(key.size, output_bytes) if forecast is not None else contextlib.nullcontext():
            self._capture_one(key, state, forward_fn, capture_inputs, post_warmup_hook, output_bytes)
        if forecast is not None:
            forecast.key_done(key.size, num_segments(self._graphs[key]))

    def _capture_one(self, key: Any, state: CaptureState, forward_fn: Callable[[], Any], capture_inputs: Any,
                     post_warmup_hook: Callable[[], None] | None, output_bytes: list[int]) -> None:
        seam = self._seam
        state.begin(key)
        mod = _bcg_module()
        start = time.perf_counter()
        warmup_out = self._warmups(key, forward_fn, post_warmup_hook)
        reserve_from_warmup(state, key, self._cuda_graph_runner, warmup_out)
        del warmup_out
        graph = mod.BreakableCUDAGraph(self.deduped_cuda_graph) if seam.graph_takes_dedup else mod.BreakableCUDAGraph()  # type: ignore[attr-defined]
        with gc_safe_capture(), self._capture_context(mod, graph):
            if seam.precarve:
                self._precarve.mint()  # type: ignore[attr-defined]
            if self._debug_eager:
                # The whole forward is one eager break; its output (held by the break) is what
                # the policy copies from. The model's own breaks inside it run inline.
                def whole_forward() -> Any:  # a named function: releases <= 0.5.21 log its __name__
                    return run_outside_capture(mod.BreakableCUDAGraphCapture, forward_fn)

                out = eager_break(mod, whole_forward, seam.eager_form)()
            else:
                out = forward_fn()
            output_bytes.extend(t.untyped_storage().nbytes() for _, t in flatten(out)[1])
            out = apply_runner_rows(out, runner_rows(self._cuda_graph_runner, out)[0])
            state.policy.place(key, out, input_storages(capture_inputs))  # in-graph copy into the shared slice
        del out
        output = state.commit(  # released: the policy dropped its last reference to the graph's own output
            key, graph=graph, num_segments=num_segments(graph), capture_inputs=capture_inputs,
            seconds=time.perf_counter() - start,
        )
        self._graphs[key] = graph
        self._outputs[key] = output

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
    base = _bcg_module().BreakableCudaGraphBackend
    return type(
        "SGLangBreakableBackend",
        (SharingPolicyMixin, base),
        {"__module__": __name__, "__doc__": "SGLang's breakable CUDA graphs with our output-sharing policy."},
    )
