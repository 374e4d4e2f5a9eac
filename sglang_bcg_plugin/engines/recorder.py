"""The one segment recorder: ``segment, step, segment, step, ..., segment`` for one shape key.

Every segmented capture — Breakable (breaks marked with ``@graph_break``) and Piecewise (FX
pieces split at splitting ops) — is recorded here; the front-ends (``engines/breakable.py``,
``backends/piecewise/front.py``) only decide *where* a break is and *what* crosses it.

* :class:`Segments` makes segments: ``engines.cuda_segments.CudaSegments`` (one ``torch.cuda.CUDAGraph``
  per segment in the partition's pool; ``None`` for a segment that captured no work) or
  :class:`~.tape.EagerSegments` (CPU machines: every op run while a segment is open, recorded by a
  dispatch mode as a stream capture records kernels, plus the front-ends' actions; re-run in
  order at replay).
* :class:`Recorder` opens segment 0, closes a segment and runs the eager work of a break
  (:meth:`Recorder.eager_break`), reopens, appends the break's replay step, and aborts every
  segment when anything fails (:func:`record`).
* a host read inside a segment (``.item()``, ``bool(t)``, ``.tolist()``, ``nonzero``) is
  refused with :class:`~sglang_bcg_plugin.errors.HostReadError`: by the op tape before the op
  runs on the eager segments, and on CUDA translated from the error the stream capture raised
  (:func:`host_read_error`), so both engines name the key and the segment alike.
* :class:`SegmentedGraph` replays ``run(segment 0), step 0, run(segment 1), step 1, ...`` and
  holds strong references to everything crossing a boundary (weak references let later captures
  re-carve the memory: SGLang #37606).
"""

from __future__ import annotations

import contextlib
import contextvars
import traceback
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from ..errors import HostReadError, user_frame
from ..storage import copy_broadcast


Action = Callable[[], None]


class Segments(Protocol):
    """How segments are made and replayed."""

    #: ``record``-ed actions are re-run at replay (eager segments), so what they read is kept;
    #: ``False`` (CUDA graphs): nothing need outlive the call that recorded it.
    reruns_actions: bool

    def begin(self) -> None: ...
    def end(self) -> None: ...
    def record(self, action: Action) -> None:
        """Remember work to redo at replay (no-op on CUDA, where the kernels were captured)."""

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """Work inside is not recorded by the open segment (its replay is recorded another way)."""

    def abort(self) -> None: ...
    def runners(self) -> list[Action | None]: ...
    def release(self) -> None: ...


def untracked() -> contextlib.AbstractContextManager[None]:
    """Pause the open eager segment of the capture running in this context (if any): for work
    whose replay is recorded otherwise (a compiled callable's pieces, a break's own result)."""
    rec = _active.get()
    return rec.segments.paused() if rec is not None else contextlib.nullcontext()


def refresh(static: torch.Tensor, value: torch.Tensor, what: str) -> None:
    """Write a replayed ``value`` into the captured ``static`` storage (a no-op when it is that
    storage already), as a graph replay rewrites the memory it owns.

    :raises RuntimeError: the shape changed since capture; ``what`` names the producer.
    """
    if static.shape != value.shape:
        msg = f"{what} returned shape {tuple(value.shape)} on replay, captured {tuple(static.shape)}"
        raise RuntimeError(msg)
    if static is not value and not (
        static.data_ptr() == value.data_ptr() and static.stride() == value.stride()
    ):
        try:
            static.copy_(value)
        except RuntimeError:
            # a broadcast output (stride 0): write the elements it views (nothing on the fast path)
            if not copy_broadcast(static, value, what):
                raise


#: What CUDA and torch say when work inside a stream capture synchronises with the host (a value
#: read on the host: ``.item()``, ``bool(t)``, ``nonzero``, a copy to pageable host memory), or
#: what a capture that did so says next.
_CUDA_HOST_SYNC = (
    "operation not permitted when stream is capturing",
    "cudaErrorStreamCaptureUnsupported",
    "Cannot copy between CPU and CUDA tensors during CUDA graph capture",
    "operation failed due to a previous error during capture",
    "cudaErrorStreamCaptureInvalidated",
)


def host_read_error(exc: BaseException, key: object, segment: int | None) -> HostReadError | None:
    """The :class:`HostReadError` a CUDA capture failure stands for (the stream capture refused a
    host sync, most often a tensor's value read on the host), or ``None`` for any other error.
    An error the eager tape raised is returned as it is."""
    if isinstance(exc, HostReadError):
        return exc
    text = str(exc)
    if not isinstance(exc, RuntimeError) or not any(m in text for m in _CUDA_HOST_SYNC):
        return None
    frames = [(f.filename, f.lineno or 0, f.name) for f in traceback.extract_tb(exc.__traceback__)]
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    op = f"a host sync the stream capture refused: {first.strip()}"
    return HostReadError(key, segment, op, user_frame(frames))


class SegmentedGraph:
    """One captured key: segments with the eager steps between them."""

    def __init__(self, key: object, segments: Segments, steps: list[Action], output: Any, held: list[Any]) -> None:
        self.key = key
        self.output = output
        self._segments: Segments | None = segments
        self._runners = segments.runners()
        self._steps = steps
        self._held = held  # strong references to everything crossing a segment boundary
        self.num_segments = len(self._runners)
        # Replay runs the eager work (breaks, the op tape) in the autograd mode of the capture: a
        # capture under torch.inference_mode() made inference tensors, which only inference mode
        # may write (a graph's kernels write them anywhere). Same cost as no_grad.
        self._mode = torch.inference_mode if torch.is_inference_mode_enabled() else torch.no_grad

    @property
    def steps(self) -> tuple[Action, ...]:
        """The eager steps replayed between segments, in order (step ``i`` runs after segment
        ``i``): a break's or a splitting op's call with what it keeps (read-only; empty once
        released)."""
        return tuple(self._steps)

    def replay(self) -> Any:
        if self._segments is None:
            msg = f"graph of {self.key!r} was released; capture it again"
            raise RuntimeError(msg)
        steps = self._steps
        with self._mode():
            for i, run in enumerate(self._runners):
                if run is not None:
                    run()
                if i < len(steps):
                    steps[i]()
        return self.output

    def release(self) -> None:
        if self._segments is not None:
            self._segments.release()
        self._segments = None
        self._runners = []
        self._steps = []
        self._held = []


class Recorder:
    """Records the segments and eager steps of one key; front-ends subclass it."""

    def __init__(self, key: object, segments: Segments) -> None:
        self.key = key
        self.segments = segments
        self.steps: list[Action] = []
        self.held: list[Any] = []
        self.segment = 0  # the open segment's index
        self._in_break = False

    @property
    def in_break(self) -> bool:
        """Whether eager break work is running (nested breaks and pieces run as plain calls)."""
        return self._in_break

    @contextlib.contextmanager
    def eager_break(self) -> Iterator[None]:
        """Close the open segment, run the body eagerly, then open the next segment."""
        self.segments.end()
        self._in_break = True
        try:
            yield
        finally:
            self._in_break = False
        self.segments.begin()
        self.segment += 1

    def add_step(self, step: Action, held: Any) -> None:
        """The replay work of the break just run, and what it must keep alive."""
        self.steps.append(step)
        self.held.append(held)

    def finish(self, output: Any, finalize: Callable[[Any], Any]) -> Any:
        """Apply the output policy inside the last segment; returns the static output."""
        return finalize(output)

    def graph(self, output: Any) -> SegmentedGraph:
        return SegmentedGraph(self.key, self.segments, self.steps, output, self.held)


_active: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar("sglang_bcg_recorder", default=None)


def active_recorder() -> Recorder | None:
    """The recorder of the segmented capture running in this context, if any."""
    return _active.get()


def record(recorder: Recorder, forward_fn: Callable[[], Any], finalize: Callable[[Any], Any]) -> SegmentedGraph:
    """Run ``forward_fn`` with ``recorder`` active; returns the captured graph.

    On any failure every segment is aborted (the stream is left not capturing, graphs reset).

    :raises HostReadError: the forward read a tensor's value on the host inside a segment.
    """
    token = _active.set(recorder)
    try:
        recorder.segments.begin()
        output = recorder.finish(forward_fn(), finalize)
        recorder.segments.end()
    except BaseException as exc:
        recorder.segments.abort()
        host = host_read_error(exc, recorder.key, recorder.segment)
        if host is not None and host is not exc:
            raise host from exc
        raise
    finally:
        _active.reset(token)
    return recorder.graph(output)
