"""``CaptureBackend``: the contract every backend implements (docs/index.md#backends); ``capture_one``
reads top-down: check → observers → the engine (warmups, the recording) → ``state.commit`` → observers."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, cast

import pluggy
import torch

from ..accounting import Measure, device_free_bytes
from ..engines.base import CaptureRequest, Engine, Front
from ..engines.cuda import FullCudaEngine, SegmentCudaEngine
from ..engines.eager import EagerEngine, EagerSegmentEngine
from ..engines.gcsafe import gc_safe_capture
from ..errors import CaptureStateError
from ..forecast.allocator import ALLOC_CONF_VARS, expandable_segments
from ..manager import get_plugin_manager, observe_finished, observe_started
from ..options import BackendOptions
from ..output.mode import OutputMode, Resolution, explain_output_mode
from ..output.report import MemoryReport
from ..output.scan import short_repr
from ..output.plan import plan_session
from ..output.state import CaptureState, check_input_pointers, input_storages

if TYPE_CHECKING:
    from ..forecast.probe import GraphMemoryForecast


@contextlib.contextmanager
def allocator_segments(choice: str, engine: Engine) -> Iterator[None]:
    """``pool_segments="expandable"`` on a CUDA engine: ``expandable_segments`` on while the session is open.
    :raises RuntimeError: this torch cannot switch it at run time."""
    if choice != "expandable" or engine.name != "cuda" or expandable_segments():
        yield
        return
    setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if setter is None:
        msg = ("pool_segments='expandable' needs torch.cuda.memory._set_allocator_settings, which this torch "
               f"({torch.__version__}) lacks; set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True instead")
        raise RuntimeError(msg)
    # the process's own settings are given again: some torch parsers reset the keys left out
    conf = [v for v in (os.environ.get(var, "").strip() for var in ALLOC_CONF_VARS) if v]
    try:
        setter(",".join([*conf, "expandable_segments:True"]))
    except RuntimeError as exc:
        msg = f"pool_segments='expandable': torch refused to switch expandable_segments on ({exc})"
        raise RuntimeError(msg) from None
    try:
        yield
    finally:
        setter(",".join([*conf, "expandable_segments:False"]))


class ShapeKeyLike(Protocol):
    """What :func:`check_key` proves of a shape key, ours or SGLang's: hashable, with ``size`` and ``stream_idx``."""

    @property
    def size(self) -> int: ...
    @property
    def stream_idx(self) -> int | None: ...
    def __hash__(self) -> int: ...


def check_key(key: object) -> ShapeKeyLike:
    """The key :meth:`CaptureBackend.capture_one` takes: any hashable object with ``size`` (an int >= 1)
    and ``stream_idx`` (our ``ShapeKey`` or SGLang's).

    :raises TypeError: no ``size``/``stream_idx``, or not hashable. :raises ValueError: a bad ``size``."""
    size = getattr(key, "size", None)
    if not hasattr(key, "stream_idx") or size is None:
        raise TypeError(f"shape key {key!r} ({type(key).__name__}) needs 'size' and 'stream_idx' attributes; use "
                        "sglang_bcg_plugin.ShapeKey or SGLang's ShapeKey")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"shape key {key!r} has size {size!r}; expected an int >= 1")
    try:
        hash(key)
    except TypeError:
        raise TypeError(f"shape key {key!r} ({type(key).__name__}) is not hashable") from None
    return cast(ShapeKeyLike, key)  # checked above: size an int >= 1, stream_idx present, hashable


class CaptureBackend:
    """Base class of the Full, Breakable and Piecewise backends."""

    name: ClassVar[str] = "base"
    #: the front of a segmented backend's engines (``None``: whole-forward graphs)
    _front: ClassVar[type[Front] | None] = None

    def __init__(self, *, options: BackendOptions | None = None, plugin_manager: pluggy.PluginManager | None = None,
                 output_mode: Resolution | None = None) -> None:
        """:param output_mode: a mode a host resolved (below ``options.output_mode``, above the
            environment). :raises TypeError: ``output_mode`` is not a ``Resolution``."""
        self._options = options or BackendOptions()
        self._pm = plugin_manager or get_plugin_manager()
        if output_mode is not None and not isinstance(output_mode, Resolution):
            raise TypeError(f"{self.name} backend: output_mode= takes a Resolution (a mode with its reason), got "
                            f"{output_mode!r}; give a mode as options=BackendOptions(output_mode=...)")
        self._host_resolution = output_mode
        self._lock = threading.RLock()
        self._state = CaptureState(self.name, "none")
        self._stream: Any = None
        self._engine: Engine | None = None
        self._capturing: Hashable | None = None  # the key being captured (re-entrancy check)

    @property
    def options(self) -> BackendOptions:
        return self._options

    def configure(self, **changes: Any) -> BackendOptions:
        """Replace option fields; they apply from the next capture session on."""
        with self._lock:
            self._options = dataclasses.replace(self._options, **changes)
            if "engine" in changes and not self._state.keys() and self._engine is not None:
                self._engine.release()
                self._engine = None
            return self._options

    def compile(self, model: Callable[..., Any], *, dynamic: str = "auto", dynamic_dim: int = 0) -> Callable[..., Any]:
        """The callable a forward should call: ``model`` itself, except on a compiling backend."""
        return model

    @property
    def engine_name(self) -> str:
        """``"cuda"`` or ``"eager"``: the engine this backend captures with."""
        return self._get_engine().name

    def _use_cuda(self) -> bool:
        """Whether this backend captures real CUDA graphs here (option ``engine``)."""
        engine = self._options.engine
        if engine == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"{self.name} backend: engine='cuda' but CUDA is not available; use 'auto' or 'eager'")
        return engine != "eager" and torch.cuda.is_available()

    def _get_engine(self) -> Engine:
        if self._engine is None:
            if self._use_cuda():
                self._engine = self._make_cuda_engine()
            else:
                self._engine = EagerEngine() if self._front is None else EagerSegmentEngine(self._front())
            self._state.engine = self._engine.name
        return self._engine

    def _make_cuda_engine(self) -> Engine:
        """The engine on CUDA; a subclass may return its own (docs/writing-a-backend.md)."""
        return FullCudaEngine() if self._front is None else SegmentCudaEngine(self._front())

    @contextlib.contextmanager
    def capture_session(self, stream: Any = None) -> Iterator[None]:
        """Open a capture session; its plan is fixed until it closes. :raises CaptureStateError: one is open."""
        with self._lock:
            opts, engine = self._options, self._get_engine()
            plan = plan_session(self._next_output_mode(), engine=engine.name, shared_buffer=opts.shared_buffer,
                                pool_reserve=opts.pool_reserve, guard=opts.stale_output_guard,
                                strict=opts.strict_outputs, check_inputs=opts.debug_check_inputs,
                                captured=bool(self._state.keys()),
                                advice=None if self._state.forecast is None else self._state.forecast.advice)
            self._state.open(plan)
            self._stream = stream
        # after a forecast, the session's device memory is measured to compare with it
        measure = self._state.forecast is not None and engine.name == "cuda"
        try:
            if plan.pool_reserve_bytes and hasattr(engine, "reserve_pool"):  # our CUDA engines (a plugin's may not)
                engine.reserve_pool(plan.pool_reserve_bytes)
            with (allocator_segments(opts.pool_segments, engine),
                  gc_safe_capture() if engine.name != "eager" else contextlib.nullcontext()):
                free_before = device_free_bytes(collect=False) if measure else None
                yield
                if free_before is not None:
                    self._state.measured_graph_bytes = free_before - device_free_bytes(collect=False)
        finally:
            with self._lock:
                self._state.close()
                self._stream = None

    def _next_output_mode(self) -> Resolution:
        """The output mode the next capture session resolves to, and why."""
        opts = self._options
        return explain_output_mode(opts.output_mode if opts.output_mode is not None else self._host_resolution)

    def forecast(self, sizes: Iterable[int], forward_for: Callable[[int], Callable[[], Any]],
                 capture_inputs: Any = None) -> GraphMemoryForecast:
        """Forecast the graph memory of capturing ``sizes`` per output mode, before any capture; the next
        session's plan may use it (docs/forecast.md). ``forward_for(size)``: ``capture_one``'s ``forward_fn``;
        it runs once eagerly at every size (first launches measured), then at the probed sizes.

        :raises ForecastError: fewer than two sizes, not the CUDA engine, or forwards whose
            allocations at the two probed sizes are not one pattern.
        :raises CaptureStateError: keys are captured already, or a session is open.
        :raises TypeError: ``sizes`` is not an iterable of ints (``ValueError``: one below 1)."""
        from ..forecast.probe import forecast_schedule

        if self._state.mode_active is not None:
            raise CaptureStateError(f"{self.name} backend: forecast() inside an open capture_session()")
        result = forecast_schedule(self, sizes, forward_for, capture_inputs,
                                   configured_mode=self._next_output_mode().mode)
        self._state.forecast = result
        return result

    @property
    def output_mode_active(self) -> OutputMode | None:
        """The output mode of the open session (``None`` outside a session)."""
        return self._state.mode_active

    @property
    def last_output_mode(self) -> Resolution | None:
        """The output mode of the latest capture session and why (``None`` before the first)."""
        return self._state.resolution

    def size_context(self, size: int) -> contextlib.AbstractContextManager[None]:
        """What a forward of ``size`` runs in, in :meth:`capture_one` and the forecast's eager forwards:
        nothing here; Piecewise's compiled callables learn the size from it."""
        return contextlib.nullcontext()

    def capture_one(self, shape_key: Hashable, forward_fn: Callable[[], Any], capture_inputs: Any = None,
                    post_warmup_hook: Callable[[], None] | None = None) -> Any:
        """Warm up, capture ``forward_fn`` (no arguments) for ``shape_key``; returns its static output.
        ``capture_inputs`` (any tree) is kept alive with the graph.

        :raises CaptureStateError: no session is open, or a capture is in progress.
        :raises TypeError: ``forward_fn`` is not callable, or ``post_warmup_hook`` neither ``None`` nor callable
            (before any warmup).
        :raises ValueError: ``shape_key`` is captured already.
        :raises ObserverError: a ``sglang_bcg_capture_started`` observer raised."""
        key = check_key(shape_key)
        if not callable(forward_fn):
            raise TypeError(f"capture_one({key!r}): forward_fn must be callable (a function of no arguments), got "
                            f"{short_repr(forward_fn)} ({type(forward_fn).__name__})")
        if post_warmup_hook is not None and not callable(post_warmup_hook):
            raise TypeError(f"capture_one({key!r}): post_warmup_hook must be None or callable (a function of no "
                            f"arguments, run after each warmup), got {short_repr(post_warmup_hook)} "
                            f"({type(post_warmup_hook).__name__}); nothing was warmed up or captured")
        with self._lock, self.size_context(key.size):
            plan = self._state.begin(key)
            if self._capturing is not None:
                raise CaptureStateError(f"{self.name} backend: re-entrant capture: capture_one({key!r}) was called "
                                        f"while {self._capturing!r} is being captured (from inside its forward_fn or a "
                                        "hook); capture keys one after another")
            if key in self._state:
                msg = f"{key!r} is already captured by the {self.name} backend; cleanup() first to capture it again"
                raise ValueError(msg)
            self._capturing = key
            try:
                observe_started(self._pm, self, key)
                engine = self._get_engine()
                request = CaptureRequest(key, forward_fn, self._state.policy, num_warmups=self._options.num_warmups,
                                         post_warmup_hook=post_warmup_hook, partition=getattr(key, "stream_idx", None),
                                         stream=self._stream, static_inputs=input_storages(capture_inputs))
                with Measure(engine.name) as measured:
                    graph = engine.capture(request)
                output = self._state.commit(  # the eager engine has no pool: nothing to release
                    key, graph=graph, capture_inputs=capture_inputs, seconds=measured.seconds,
                    memory_bytes=measured.memory_bytes, can_release=plan.releases_outputs,
                )
            except BaseException as exc:
                self._state.policy.discard()
                observe_finished(self._pm, key, backend=self, report=None, error=exc)
                raise
            finally:
                self._capturing = None
            report = self._state.report().keys[-1]
            observe_finished(self._pm, key, backend=self, report=report, error=None)
            return output

    def replay(self, shape_key: Hashable) -> Any:
        """Replay the graph of ``shape_key``; returns its static output. :raises KeyError: never captured."""
        entry = self._state.entry(shape_key)
        check_input_pointers(shape_key, entry)
        return self._state.hand_out(shape_key, entry.graph.replay())

    def can_run(self, shape_key: Hashable) -> bool:
        """Whether ``replay(shape_key)`` would run a captured graph."""
        return shape_key in self._state

    def captured_keys(self) -> list[Hashable]:
        return self._state.keys()

    def num_segments(self, shape_key: Hashable) -> int:
        """:raises KeyError: ``shape_key`` was never captured."""
        return int(self._state.entry(shape_key).graph.num_segments)

    def memory_report(self) -> MemoryReport:
        """Logical vs resident output bytes, fallbacks, capture seconds per key; bridges per partition."""
        bridges = None if self._engine is None else self._engine.bridge_bytes()
        return self._state.report(bridge_bytes=bridges)

    def cleanup(self) -> None:
        """Release every graph, shared buffer and pool; the backend can capture again."""
        with self._lock:
            if self._state.mode_active is not None:
                raise CaptureStateError(f"{self.name} backend: cleanup() inside an open capture_session()")
            self._state.clear()
            if self._engine is not None:
                self._engine.release()
                self._engine = None
