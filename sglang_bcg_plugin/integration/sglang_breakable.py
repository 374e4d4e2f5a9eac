"""Our Breakable backend *inside* SGLang: SGLang's BCG segment engine, our output policy.

SGLang's prefill runner checks ``isinstance(backend, BreakableCudaGraphBackend)`` in about ten
places, and model code's ``eager_on_graph`` break points talk to SGLang's own segment engine
(``BreakableCUDAGraph`` / ``BreakableCUDAGraphCapture``). So the class built by
:func:`sglang_breakable_backend_class` *subclasses* SGLang's ``BreakableCudaGraphBackend``, keeps
its constructor ``(cuda_graph_runner, *, enable_memory_saver=False, debug_eager=False)``, and
reuses its warmups, pool, barrier and segment capture unchanged. Only the output handling
differs from SGLang 0.5.23's built-in, unconditional sharing:

* the output mode is resolved at every ``capture_session`` (:mod:`.sglang_session`): the stash
  set by ``--enable-bcg-shared-output`` > env ``SGLANG_ENABLE_BCG_SHARED_OUTPUT`` > **the
  installed SGLang's own default** (:mod:`.builtin`; 0.5.23 always shares, so ``on``);
* ``on``: :class:`~sglang_bcg_plugin.sharing.OutputSharer` semantics (``strict=False``, any
  output tree, rows from each leaf, per-key fallback), the buffer reserved from the last warmup's
  output before the capture, outside the pool (one output; adopting costs two: docs/sglang.md);
* ``released``: zero-copy outputs left in graph-pool memory (:mod:`sglang_bcg_plugin.released`),
  valid until the next replay of any graph of SGLang's process-global pool;
* ``off``: every key keeps the output its own graph wrote.

``cleanup()`` also drops SGLang's process-global pool handle when it is ours
(:func:`.sglang_session.drop_global_pool`), so a new capture session works in the same process.
With ``SGLANG_BCG_STALE_OUTPUT_GUARD=1`` replays hand out guarded views (``guard.py``; for
released outputs :class:`~sglang_bcg_plugin.released.PoolGuard`).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any

from ..engines.gcsafe import defer_release, gc_safe_capture
from ..errors import CaptureStateError
from ..guard import StaleOutputGuard
from ..output_mode import OutputMode, Resolution
from ..released import POOL_GUARD, release_output
from ..report import KeyReport, MemoryReport, claim_resident_bytes
from ..shape_key import check_key
from ..sharing import OutputSharer
from .sglang_session import (
    SessionSettings,
    apply_runner_rows,
    drop_global_pool,
    input_storages,
    open_session,
    reserve_from_warmup,
    run_outside_capture,
    runner_server_args,
)

__all__ = ["SGLANG_BCG_CLASS", "SharingPolicyMixin", "apply_runner_rows", "sglang_breakable_backend_class"]

#: Dotted path of SGLang's breakable backend class (our base class).
SGLANG_BCG_CLASS = (
    "sglang.srt.model_executor.runner_backend.breakable_cuda_graph_backend.BreakableCudaGraphBackend"
)


def _bcg_module() -> Any:
    # Read the segment engine's names from SGLang's backend module at call time, exactly where
    # SGLang's own capture_one reads them (patches of that module apply to both).
    from sglang.srt.model_executor.runner_backend import breakable_cuda_graph_backend

    return breakable_cuda_graph_backend


@dataclass(eq=False)
class _KeyInfo:
    shared: bool
    fallback: str | None
    logical_bytes: int
    seconds: float
    released: bool = False


class SharingPolicyMixin:
    """Output policy over SGLang's BCG capture; mixed in before SGLang's class."""

    # Set by SGLang's BreakableCudaGraphBackend.__init__ (0.5.23).
    _cuda_graph_runner: Any
    _graphs: dict[Any, Any]
    _outputs: dict[Any, Any]
    _capture_inputs: dict[Any, Any]
    _pool: Any
    _device_module: Any
    _tp_group: Any
    _capture_stream: Any
    _debug_eager: bool
    _precarve: Any
    deduped_cuda_graph: Any

    name = "breakable"

    def __init__(
        self, cuda_graph_runner: Any, *, enable_memory_saver: bool = False, debug_eager: bool = False
    ) -> None:
        super().__init__(  # type: ignore[call-arg]
            cuda_graph_runner, enable_memory_saver=enable_memory_saver, debug_eager=debug_eager
        )
        self._bcg_sharer: OutputSharer | None = None
        self._bcg_settings: SessionSettings | None = None
        # Of the latest session (the sharer, which holds buffers, is never kept past its session):
        self._bcg_guard: StaleOutputGuard | None = None  # serves every replay
        self._bcg_resolution: Resolution | None = None
        self._bcg_keys: dict[Hashable, _KeyInfo] = {}

    @contextlib.contextmanager
    def capture_session(self, stream: Any) -> Iterator[None]:
        """SGLang's session (pool, dedup, BCG mode) plus a freshly resolved output policy."""
        settings = open_session(runner_server_args(self._cuda_graph_runner), self._bcg_guard)
        # The guard read now applies to every replay from now on (as in our own backends).
        self._bcg_settings, self._bcg_sharer = settings, settings.sharer
        self._bcg_guard, self._bcg_resolution = settings.guard, settings.resolution
        try:  # gc: one collection per session, not per key (docs/index.md "GC safety")
            with gc_safe_capture(), super().capture_session(stream):  # type: ignore[misc]
                yield
        finally:
            self._bcg_settings, self._bcg_sharer = None, None

    @property
    def share_output_active(self) -> bool | None:
        """Whether the open capture session shares outputs (``None`` outside one)."""
        return None if self._bcg_sharer is None else self._bcg_sharer.enabled

    @property
    def last_output_mode(self) -> Resolution | None:
        """The output mode of the latest capture session and why (``None`` before the first)."""
        return self._bcg_resolution

    @property
    def output_mode_active(self) -> OutputMode | None:
        """The output mode of the open capture session (``None`` outside one)."""
        return None if self._bcg_settings is None else self._bcg_settings.resolution.mode

    def capture_one(
        self,
        shape_key: Any,
        forward_fn: Callable[[], Any],
        capture_inputs: Any | None = None,
        post_warmup_hook: Callable[[], None] | None = None,
    ) -> None:
        """SGLang's warmups and segment capture; the output goes through our policy."""
        key = check_key(shape_key)
        sharer, settings = self._bcg_sharer, self._bcg_settings
        if sharer is None or settings is None:
            msg = f"capture_one({key!r}) must run inside `with backend.capture_session(stream):`"
            raise CaptureStateError(msg)
        mod = _bcg_module()
        start = time.perf_counter()
        warmup_out = None
        for _ in range(2):  # two warmups, as SGLang does, so lazy kernels settle first
            self._device_module.synchronize()
            self._tp_group.barrier()
            with self._precarve.measure():
                warmup_out = forward_fn()
            if post_warmup_hook is not None:
                post_warmup_hook()
        # reserve: the shared buffer comes from the last warmup, outside the graph pool.
        if settings.strategy == "reserve":
            reserve_from_warmup(sharer, key, self._cuda_graph_runner, warmup_out)
        del warmup_out
        protected = input_storages(capture_inputs)
        graph = mod.BreakableCUDAGraph(self.deduped_cuda_graph)
        with (
            gc_safe_capture(),
            mod.graph_pool_capture_scope(),
            mod.BreakableCUDAGraphCapture(
                cuda_graph=graph, pool=self._pool, stream=self._capture_stream, barrier_fn=self._tp_group.barrier
            ),
        ):
            self._precarve.mint()
            if self._debug_eager:
                # The whole forward is one eager break; its output (held by the break) is the
                # bridge buffer the policy below copies from or adopts. The model's own
                # eager_on_graph breaks inside it run inline (SGLang 0.5.23's debug path asserts).
                out = mod.eager_on_graph(functools.partial(run_outside_capture, forward_fn))()
            else:
                out = forward_fn()
            out = apply_runner_rows(out, self._cuda_graph_runner.cuda_graph_output_rows(out))
            prepared = sharer.prepare(key, out, protected)  # in-graph copy into the shared slice
        prepared.commit()
        info = _KeyInfo(prepared.shared, prepared.fallback, prepared.logical_bytes, 0.0, settings.released)
        output = prepared.output
        if settings.released:
            # Non-owning aliases; dropping the last strong references returns the blocks to the pool.
            output = release_output(output)
            del out, prepared
        self._graphs[key] = graph
        self._outputs[key] = output
        # CUDA graphs retain tensor addresses, not Python tensor lifetimes.
        self._capture_inputs[key] = capture_inputs
        info.seconds = time.perf_counter() - start
        self._bcg_keys[key] = info

    def __del__(self) -> None:  # dropped inside a capture: SGLang's graphs die after it
        defer_release(list(getattr(self, "_graphs", {}).values()))
        getattr(super(), "__del__", lambda: None)()  # SGLang's dedup mixin closes its registry

    def replay(self, shape_key: Any, static_forward_batch: Any, **kwargs: Any) -> Any:
        """SGLang's replay; with the stale-output guard on, guarded views of the output."""
        out = super().replay(shape_key, static_forward_batch, **kwargs)  # type: ignore[misc]
        guard = self._bcg_guard
        if guard is None:
            return out
        info = self._bcg_keys.get(shape_key)
        if info is not None and info.released:
            return POOL_GUARD.replayed(self._pool, self, shape_key, out)
        POOL_GUARD.replayed(self._pool, self, shape_key)  # another graph of the pool ran
        return guard.hand_out(shape_key, out)

    def memory_report(self) -> MemoryReport:
        """Logical vs resident output bytes, fallbacks and capture seconds, per key."""
        seen: set[tuple[str, int]] = set()
        keys = []
        for key, info in self._bcg_keys.items():
            resident = 0 if info.released else claim_resident_bytes(self._outputs[key], seen)
            keys.append(
                KeyReport(
                    key=key,
                    logical_output_bytes=info.logical_bytes,
                    resident_output_bytes=resident,
                    shared=info.shared,
                    fallback=info.fallback,
                    capture_seconds=info.seconds,
                    graph_memory_bytes=None,
                    num_segments=len(self._graphs[key]._segments),
                )
            )
        return MemoryReport.from_keys(self.name, "sglang-bcg", keys)

    def cleanup(self) -> None:
        """SGLang's cleanup, our accounting, and a usable global pool for the next session."""
        pool = self._pool
        super().cleanup()  # type: ignore[misc]
        self._bcg_keys.clear()
        self._bcg_sharer = self._bcg_settings = None
        if self._bcg_guard is not None:
            self._bcg_guard.clear()
        POOL_GUARD.forget(self)
        drop_global_pool(pool)


@functools.cache
def sglang_breakable_backend_class() -> type[Any]:
    """Our breakable backend class, a subclass of SGLang's ``BreakableCudaGraphBackend``.

    Built on first call (imports SGLang) and cached, so every caller gets the same class.
    """
    base = _bcg_module().BreakableCudaGraphBackend
    return type(
        "SGLangBreakableBackend",
        (SharingPolicyMixin, base),
        {"__module__": __name__, "__doc__": "SGLang's breakable CUDA graphs with our output-sharing policy."},
    )
