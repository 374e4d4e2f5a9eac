"""Our Breakable backend *inside* SGLang: SGLang's BCG segment engine, our output policy.

SGLang's prefill runner checks ``isinstance(backend, BreakableCudaGraphBackend)`` in about ten
places, and model code's ``eager_on_graph`` break points talk to SGLang's own segment engine
(``BreakableCUDAGraph`` / ``BreakableCUDAGraphCapture``). So the class built by
:func:`sglang_breakable_backend_class` *subclasses* SGLang's ``BreakableCudaGraphBackend``, keeps
its constructor ``(cuda_graph_runner, *, enable_memory_saver=False, debug_eager=False)``, and
reuses its warmups, pool, barrier and segment capture unchanged. Only the output handling
differs from SGLang 0.5.23's built-in, unconditional sharing:

* the switch is resolved at every ``capture_session`` with
  ``resolve_share_output(None, server_args=<the runner's ServerArgs>)`` (stash set by
  ``--enable-bcg-shared-output`` > env ``SGLANG_ENABLE_BCG_SHARED_OUTPUT`` > off);
* on: :class:`~sglang_bcg_plugin.sharing.OutputSharer` semantics (``strict=False``): one buffer
  per leaf path per ``stream_idx``, adopted from the first (largest) capture, rows from each
  leaf, any output tree (``LogitsProcessorOutput`` and other dataclasses included), per-key
  fallback with one warning when a key does not fit;
* off: every key keeps the output its own graph wrote.

SGLang's ``_shared_output_buffer`` is never used (it is sized from the first key's
``shape_key.size``); ``cuda_graph_output_capacity_rows`` is not needed because the buffer is the
largest capture's own output.

Runner rows: when ``runner.cuda_graph_output_rows(output)`` returns an int ``R``, the *padded row
dim* ``P`` is the largest leading dim among the output's tensor leaves; every leaf whose leading
dim equals ``P`` is handed out as ``leaf[:R]`` (only when ``R < P``). Leaves with another leading
dim (per-request tensors next to per-token ones) keep all their rows. ``None`` (SGLang 0.5.23's
default) leaves the output as the body produced it.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any

from ..engines.gcsafe import gc_safe_capture
from ..errors import CaptureStateError
from ..options import resolve_share_output
from ..report import KeyReport, MemoryReport, claim_resident_bytes
from ..shape_key import check_key
from ..sharing import OutputSharer
from ..trees import collect_tensors, flatten, storage_key, unflatten

#: Dotted path of SGLang's breakable backend class (our base class).
SGLANG_BCG_CLASS = (
    "sglang.srt.model_executor.runner_backend.breakable_cuda_graph_backend.BreakableCudaGraphBackend"
)


def _bcg_module() -> Any:
    # Read the segment engine's names from SGLang's backend module at call time, exactly where
    # SGLang's own capture_one reads them (patches of that module apply to both).
    from sglang.srt.model_executor.runner_backend import breakable_cuda_graph_backend

    return breakable_cuda_graph_backend


def runner_server_args(cuda_graph_runner: object) -> object | None:
    """SGLang's ``ServerArgs`` reachable from a graph runner, else this process's, else ``None``."""
    server_args: object | None = getattr(getattr(cuda_graph_runner, "model_runner", None), "server_args", None)
    if server_args is not None:
        return server_args
    try:
        from sglang.srt.runtime_context import get_server_args

        published: object = get_server_args()
        return published
    except (ImportError, ValueError, AttributeError):  # not published in this process
        return None


def apply_runner_rows(output: Any, rows: object) -> Any:
    """Trim the padded-row leaves of ``output`` to ``rows`` (see the module docstring)."""
    if rows is None:
        return output
    if isinstance(rows, bool) or not isinstance(rows, int):
        msg = f"cuda_graph_output_rows() returned {rows!r}; expected None or an int >= 0"
        raise TypeError(msg)
    if rows < 0:
        msg = f"cuda_graph_output_rows() returned {rows}; expected None or an int >= 0"
        raise ValueError(msg)
    node, leaves = flatten(output)
    padded = max((t.shape[0] for _, t in leaves if t.dim() > 0), default=None)
    if padded is None or rows >= padded:
        return output
    return unflatten(node, [t[:rows] if t.dim() > 0 and t.shape[0] == padded else t for _, t in leaves])


def _input_storages(capture_inputs: object) -> frozenset[tuple[str, int]]:
    """Storages of static inputs (any object, e.g. a ForwardBatch), never adopted as a buffer."""
    return frozenset(storage_key(t) for t in collect_tensors(capture_inputs))


#: SGLang's "capture in progress" context variable (read by every ``eager_on_graph`` wrapper).
CAPTURE_VAR = (
    "sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph.breakable_cuda_graph"
    "._current_capture_var"
)


def _run_outside_capture(forward_fn: Callable[[], Any]) -> Any:
    import pkgutil

    var = pkgutil.resolve_name(CAPTURE_VAR)
    token = var.set(None)
    try:
        return forward_fn()
    finally:
        var.reset(token)


@dataclass(eq=False)
class _KeyInfo:
    shared: bool
    fallback: str | None
    logical_bytes: int
    seconds: float


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
        self._bcg_keys: dict[Hashable, _KeyInfo] = {}

    @contextlib.contextmanager
    def capture_session(self, stream: Any) -> Iterator[None]:
        """SGLang's session (pool, dedup, BCG mode) plus a fresh sharing policy."""
        share = resolve_share_output(None, server_args=runner_server_args(self._cuda_graph_runner))
        self._bcg_sharer = OutputSharer(enabled=share, strict=False)
        try:
            with super().capture_session(stream):  # type: ignore[misc]
                yield
        finally:
            self._bcg_sharer = None

    @property
    def share_output_active(self) -> bool | None:
        """The sharing setting of the open capture session (``None`` outside one)."""
        return None if self._bcg_sharer is None else self._bcg_sharer.enabled

    def capture_one(
        self,
        shape_key: Any,
        forward_fn: Callable[[], Any],
        capture_inputs: Any | None = None,
        post_warmup_hook: Callable[[], None] | None = None,
    ) -> None:
        """SGLang's warmups and segment capture; the output goes through our policy."""
        key = check_key(shape_key)
        sharer = self._bcg_sharer
        if sharer is None:
            msg = f"capture_one({key!r}) must run inside `with backend.capture_session(stream):`"
            raise CaptureStateError(msg)
        mod = _bcg_module()
        start = time.perf_counter()
        for _ in range(2):  # two warmups, as SGLang does, so lazy kernels settle first
            self._device_module.synchronize()
            self._tp_group.barrier()
            with self._precarve.measure():
                forward_fn()
            if post_warmup_hook is not None:
                post_warmup_hook()
        protected = _input_storages(capture_inputs)
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
                out = mod.eager_on_graph(functools.partial(_run_outside_capture, forward_fn))()
            else:
                out = forward_fn()
            out = apply_runner_rows(out, self._cuda_graph_runner.cuda_graph_output_rows(out))
            prepared = sharer.prepare(key, out, protected)  # in-graph copy into the shared slice
        prepared.commit()
        self._graphs[key] = graph
        self._outputs[key] = prepared.output
        # CUDA graphs retain tensor addresses, not Python tensor lifetimes.
        self._capture_inputs[key] = capture_inputs
        self._bcg_keys[key] = _KeyInfo(
            prepared.shared, prepared.fallback, prepared.logical_bytes, time.perf_counter() - start
        )

    def memory_report(self) -> MemoryReport:
        """Logical vs resident output bytes, fallbacks and capture seconds, per key."""
        seen: set[tuple[str, int]] = set()
        keys = []
        for key, info in self._bcg_keys.items():
            resident = claim_resident_bytes(self._outputs[key], seen)
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
        """SGLang's cleanup, plus our per-key accounting."""
        super().cleanup()  # type: ignore[misc]
        self._bcg_keys.clear()
        self._bcg_sharer = None


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
