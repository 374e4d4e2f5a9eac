"""``CaptureBackend``: the contract every backend implements.

Lifecycle: 1. ``backend = create_backend(name, options=...)``.
2. ``with backend.capture_session(stream=None):`` resolves the output mode (``off``, ``on``,
   ``released``: docs/index.md, "The switch") and starts a fresh set of shared partitions.
3. ``backend.capture_one(key, forward_fn, capture_inputs, post_warmup_hook)`` per key, largest
   first: warmups, capture, output policy, through the ``sglang_bcg_capture_one`` hook.
4. ``backend.replay(key)`` returns the static output. 5. ``cleanup()`` drops every graph.

Changing options (``configure``) takes effect at the next session (captured graphs keep their storage).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Hashable, Iterator
from typing import Any, ClassVar

import pluggy

from ..engines.base import CaptureRequest, Engine
from ..engines.eager import EagerEngine
from ..engines.gcsafe import gc_safe_capture
from ..errors import CaptureStateError
from ..guard import StaleOutputGuard
from ..manager import get_plugin_manager, hookimpl
from ..options import BackendOptions
from ..output_mode import ON, RELEASED, OutputMode, resolve_output_mode
from ..released import release_output
from ..report import MemoryReport
from ..shape_key import check_key
from ..sharing import OutputSharer
from ..trees import collect_tensors, storage_key
from .session import _Entry, _Session, buffer_source, make_guard, report_of, use_cuda


class CaptureBackend:
    """Base class of the Full, Breakable and Piecewise backends."""

    name: ClassVar[str] = "base"

    def __init__(
        self,
        *,
        options: BackendOptions | None = None,
        plugin_manager: pluggy.PluginManager | None = None,
        server_args: object | None = None,
    ) -> None:
        self._options = options or BackendOptions()
        self._pm = plugin_manager or get_plugin_manager()
        self._server_args = server_args
        self._lock = threading.RLock()
        self._entries: dict[Hashable, _Entry] = {}
        self._session: _Session | None = None
        self._engine: Engine | None = None
        self._pending_stats: dict[Hashable, tuple[float, int | None]] = {}
        self._guard: StaleOutputGuard | None = None
        self._capturing: Hashable | None = None  # the key being captured (re-entrancy check)

    @property
    def options(self) -> BackendOptions:
        return self._options

    def configure(self, **changes: Any) -> BackendOptions:
        """Replace option fields; they apply from the next capture session on."""
        with self._lock:
            if "share_output" in changes:  # the deprecated alias (BackendOptions warns)
                legacy = BackendOptions(share_output=changes.pop("share_output"))
                changes.setdefault("output_mode", legacy.output_mode)
            self._options = dataclasses.replace(self._options, **changes)
            if "engine" in changes and not self._entries and self._engine is not None:
                self._engine.release()
                self._engine = None
            return self._options

    @property
    def engine_name(self) -> str:
        """``"cuda"`` or ``"eager"``: the engine this backend captures with."""
        return self._get_engine().name

    def _use_cuda(self) -> bool:
        return use_cuda(self._options.engine, self.name)

    def _get_engine(self) -> Engine:
        if self._engine is None:
            self._engine = self._make_cuda_engine() if self._use_cuda() else self._make_eager_engine()
        return self._engine

    def _make_eager_engine(self) -> Engine:
        """The engine without CUDA graphs (CPU machines, ``engine="eager"``)."""
        return EagerEngine()

    def _make_cuda_engine(self) -> Engine:  # pragma: no cover - overridden per backend
        raise NotImplementedError

    @contextlib.contextmanager
    def capture_session(self, stream: Any = None) -> Iterator[None]:
        """Open a capture session; sharing is resolved now and fixed until it closes."""
        with self._lock:
            if self._session is not None:
                msg = f"{self.name} backend: capture_session() is already open; sessions do not nest"
                raise CaptureStateError(msg)
            mode = resolve_output_mode(self._options.output_mode, server_args=self._server_args)
            share = mode == ON
            self._guard = make_guard(self._options.stale_output_guard, self._guard)
            engine = self._get_engine()
            source = buffer_source(self._options.shared_buffer, engine)
            sharer = OutputSharer(enabled=share, strict=self._options.strict_outputs, source=source)
            self._session = _Session(share, sharer, stream, mode)
        try:
            # GC safety: one collection per session, not per key; graphs only on CUDA engines.
            with gc_safe_capture() if engine.name != "eager" else contextlib.nullcontext():
                yield
        finally:
            with self._lock:
                self._session = None

    @property
    def share_output_active(self) -> bool | None:
        """Whether the open session shares outputs (mode ``on``; ``None`` outside a session)."""
        return None if self._session is None else self._session.share_output

    @property
    def output_mode_active(self) -> OutputMode | None:
        """The output mode of the open session (``None`` outside a session)."""
        return None if self._session is None else self._session.mode

    def capture_one(
        self,
        shape_key: Hashable,
        forward_fn: Callable[[], Any],
        capture_inputs: Any = None,
        post_warmup_hook: Callable[[], None] | None = None,
    ) -> Any:
        """Warm up, capture ``forward_fn`` for ``shape_key`` and return its static output.

        ``forward_fn`` takes no arguments and reads static inputs; ``capture_inputs`` (any
        tree) is kept alive with the graph, whose kernels hold its addresses.
        """
        key = check_key(shape_key)
        if not callable(forward_fn):
            msg = f"capture_one({key!r}): forward_fn must be callable, got {forward_fn!r}"
            raise TypeError(msg)
        with self._lock:
            session = self._session
            if session is None:
                msg = f"{self.name} backend: capture_one({key!r}) must run inside `with backend.capture_session():`"
                raise CaptureStateError(msg)
            if self._capturing is not None:
                msg = (
                    f"{self.name} backend: re-entrant capture: capture_one({key!r}) was called while "
                    f"{self._capturing!r} is being captured (from inside its forward_fn or a hook); "
                    "capture keys one after another"
                )
                raise CaptureStateError(msg)
            if key in self._entries:
                msg = f"{key!r} is already captured by the {self.name} backend; cleanup() first to capture it again"
                raise ValueError(msg)

            def capture() -> Any:
                return self._capture(key, forward_fn, capture_inputs, post_warmup_hook, session)

            self._capturing = key
            try:
                result = self._pm.hook.sglang_bcg_capture_one(backend=self, shape_key=key, capture=capture)
            finally:
                self._capturing = None
            if key not in self._entries:
                msg = f"a sglang_bcg_capture_one hook returned without calling capture() for {key!r}"
                raise RuntimeError(msg)
            stats = self._pending_stats.pop(key, None)
            if stats is not None:
                self._entries[key].seconds, self._entries[key].memory_bytes = stats
            return result

    def _capture(
        self,
        key: Hashable,
        forward_fn: Callable[[], Any],
        capture_inputs: Any,
        post_warmup_hook: Callable[[], None] | None,
        session: _Session,
    ) -> Any:
        if key in self._entries:
            msg = f"capture() for {key!r} was called twice"
            raise RuntimeError(msg)
        protected = frozenset(storage_key(t) for t in collect_tensors(capture_inputs))
        prepared: list[Any] = []

        def finalize(output: Any, foreign: frozenset[tuple[str, int]] | None = None) -> Any:
            p = session.sharer.prepare(key, output, protected, foreign)
            prepared.append(p)
            return p.output

        request = CaptureRequest(
            key=key,
            forward_fn=forward_fn,
            finalize=finalize,
            num_warmups=self._options.num_warmups,
            post_warmup_hook=post_warmup_hook,
            partition=getattr(key, "stream_idx", None),
            stream=session.stream,
            reserve=lambda out: session.sharer.reserve(key, out),
            static_inputs=protected,
        )
        graph = self._get_engine().capture(request)
        p = prepared.pop()
        p.commit()
        # released: non-owning aliases, the output's blocks go back to the pool (the eager engine
        # has no pool: its outputs stay owned).
        released = session.mode == RELEASED and self._get_engine().name == "cuda"
        if released:
            graph.output, p.output = release_output(graph.output), None
        self._entries[key] = _Entry(
            key, graph, capture_inputs, p.shared, session.share_output, p.fallback, p.logical_bytes, released=released
        )
        return graph.output

    def record_capture_stats(self, shape_key: Hashable, *, seconds: float, memory_bytes: int | None) -> None:
        """Called by the accounting plugin after each capture."""
        self._pending_stats[shape_key] = (seconds, memory_bytes)

    def replay(self, shape_key: Hashable) -> Any:
        """Replay the graph of ``shape_key`` and return its static output."""
        entry = self._entries.get(shape_key)
        if entry is None:
            sizes = sorted({getattr(k, "size", 0) for k in self._entries})
            msg = (
                f"{shape_key!r} was never captured by the {self.name} backend; "
                f"captured sizes: {sizes or 'none'}"
            )
            raise KeyError(msg)
        out = entry.graph.replay()
        guard = self._guard
        if guard is not None:
            return guard.hand_out(shape_key, out)
        return out

    def can_run(self, shape_key: Hashable) -> bool:
        """Whether ``replay(shape_key)`` would run a captured graph."""
        return shape_key in self._entries

    def captured_keys(self) -> list[Hashable]:
        return list(self._entries)

    def num_segments(self, shape_key: Hashable) -> int:
        return self._entries[shape_key].graph.num_segments

    def memory_report(self) -> MemoryReport:
        """Logical vs resident output bytes, fallbacks, capture seconds per key; bridges per partition."""
        return report_of(self.name, self._engine, list(self._entries.values()))

    def cleanup(self) -> None:
        """Release every graph, shared buffer and pool; the backend can capture again."""
        with self._lock:
            if self._session is not None:
                msg = f"{self.name} backend: cleanup() inside an open capture_session()"
                raise CaptureStateError(msg)
            for entry in self._entries.values():
                entry.graph.release()
            self._entries.clear()
            self._pending_stats.clear()
            if self._guard is not None:
                self._guard.clear()
            if self._engine is not None:
                self._engine.release()
                self._engine = None


@hookimpl(trylast=True)
def sglang_bcg_capture_one(backend: CaptureBackend, shape_key: object, capture: Callable[[], object]) -> object:
    """Built-in capture: just capture (wrappers around it observe)."""
    return capture()
