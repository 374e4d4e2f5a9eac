"""The one segment recorder: ``segment, step, segment, ..., segment`` for one shape key; fronts
decide where a break is and what crosses it, :class:`Segments` (CUDA graphs, the op tape) make them."""

from __future__ import annotations

import contextlib
import contextvars
import traceback
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch.utils._pytree import tree_leaves

from ..errors import HostReadError, user_frame
from ..output.trees import storage_key

Action = Callable[[], None]


class Segments(Protocol):
    """How segments are made and replayed: ``record`` remembers work to redo at replay (nothing on
    CUDA, where the kernels are captured); work inside ``paused()`` is not recorded by the open segment,
    work inside ``watched()`` not recorded but refused a host read, as a stream capture refuses it."""

    #: ``record``-ed actions are re-run at replay (eager segments): what they read is kept
    reruns_actions: bool

    def begin(self) -> None: ...
    def end(self) -> None: ...
    def record(self, action: Action) -> None: ...
    def paused(self) -> contextlib.AbstractContextManager[None]: ...
    def watched(self) -> contextlib.AbstractContextManager[None]: ...
    def abort(self) -> None: ...
    def runners(self) -> list[Action | None]: ...
    def release(self) -> None: ...


def untracked() -> contextlib.AbstractContextManager[None]:
    """Pause the open eager segment of this context's capture, if any (work replayed another way)."""
    rec = _active.get()
    return rec.segments.paused() if rec is not None else contextlib.nullcontext()


def refresh(static: torch.Tensor, value: torch.Tensor, what: str) -> None:
    """Write a replayed ``value`` into the captured ``static`` storage (no-op when it is that storage).
    :raises RuntimeError: the shape changed since capture, or a broadcast cannot hold ``value``."""
    if static.shape != value.shape:
        raise RuntimeError(f"{what} returned shape {tuple(value.shape)} on replay, captured {tuple(static.shape)}")
    if static is not value and (static.data_ptr(), static.stride()) != (value.data_ptr(), value.stride()):
        try:
            static.copy_(value)
        except RuntimeError:
            # a broadcast output (stride 0): write the elements it views (nothing on the fast path)
            if not copy_broadcast(static, value, what):
                raise


def copy_broadcast(static: torch.Tensor, value: torch.Tensor, what: str) -> bool:
    """Write ``value`` into a captured ``static`` that broadcasts (stride 0, size > 1: a graph replay rewrites only
    index 0 of each such dim, so only that is written); ``False`` when ``static`` does not broadcast (nothing written).

    :raises RuntimeError: ``value`` differs along a dim where ``static`` broadcasts."""
    dims = [d for d, (size, stride) in enumerate(zip(static.shape, static.stride(), strict=True))
            if stride == 0 and size > 1]
    if not dims:
        return False
    first = tuple(slice(0, 1) if d in dims else slice(None) for d in range(static.dim()))
    static[first].copy_(value[first])
    if all(value.stride(d) == 0 for d in dims):
        return True  # the same broadcast: nothing else to hold
    same = (torch.allclose(static, value, rtol=0.0, atol=0.0, equal_nan=True)
            if static.is_floating_point() or static.is_complex() else torch.equal(static, value))
    if not same:
        dim = next(d for d in dims if value.stride(d) != 0)
        raise RuntimeError(f"{what} returned values that vary along dim {dim} on replay, where the captured output "
                           f"broadcasts one value (stride 0, shape {tuple(static.shape)}); a CUDA graph replays the "
                           "broadcast it captured: return the same broadcast (.expand) at every call, or .contiguous()")
    return True


class Rerun:
    """Replay work: call ``fn`` again and refresh the captured tensors among ``outs`` (the leaves it
    returned at capture) with what it returns; ``what`` names it in errors."""

    __slots__ = ("what", "fn", "args", "kwargs", "outs")

    def __init__(self, what: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                 outs: list[Any]) -> None:
        self.what, self.fn, self.args, self.kwargs, self.outs = what, fn, args, kwargs, outs

    def __call__(self) -> None:
        for static, value in zip(self.outs, tree_leaves(self.fn(*self.args, **self.kwargs)), strict=True):
            if isinstance(static, torch.Tensor):
                refresh(static, value, self.what)


#: What CUDA and torch say when a stream capture refuses a host sync, or what it says next.
_CUDA_HOST_SYNC = ("operation not permitted when stream is capturing", "cudaErrorStreamCaptureUnsupported",
                   "Cannot copy between CPU and CUDA tensors during CUDA graph capture",
                   "operation failed due to a previous error during capture", "cudaErrorStreamCaptureInvalidated")


def host_read_error(exc: BaseException, key: object, segment: int | None) -> HostReadError | None:
    """The :class:`HostReadError` a CUDA capture failure stands for (a refused host sync), ``exc``
    itself when it is one, else ``None``."""
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
        self.key, self.output = key, output
        self._segments: Segments | None = segments
        self._runners = segments.runners()
        self._steps = steps
        self._held = held  # strong references to everything crossing a segment boundary
        self.num_segments = len(self._runners)
        # eager work replays in the capture's autograd mode (docs/reliability.md)
        self._mode = torch.inference_mode if torch.is_inference_mode_enabled() else torch.no_grad

    @property
    def steps(self) -> tuple[Action, ...]:
        """The eager steps replayed between segments (step ``i`` after segment ``i``); empty once released."""
        return tuple(self._steps)

    def replay(self) -> Any:
        if self._segments is None:
            raise RuntimeError(f"graph of {self.key!r} was released; capture it again")
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
        self._segments, self._runners, self._steps, self._held = None, [], [], []


class Recorder:
    """Records the segments and eager steps of one key; front-ends subclass it."""

    def __init__(self, key: object, segments: Segments) -> None:
        self.key, self.segments = key, segments
        self.steps: list[Action] = []
        self.held: list[Any] = []
        self.segment = 0  # the open segment's index
        #: eager break work is running (nested breaks and pieces run as plain calls)
        self.in_break = False

    @contextlib.contextmanager
    def eager_break(self) -> Iterator[None]:
        """Close the open segment, run the body eagerly, then open the next segment."""
        self.segments.end()
        self.in_break = True
        try:
            yield
        finally:
            self.in_break = False
        self.segments.begin()
        self.segment += 1

    def fresh_returns(self, leaves: list[Any], arg_keys: set[tuple[str, int]]) -> list[Any]:
        """Call right after :meth:`eager_break`: each tensor of ``leaves`` that aliases no argument
        replaced by graph-pool memory of the open segment (filled at once off a capture)."""
        targets = [torch.empty_like(t) if isinstance(t, torch.Tensor) and storage_key(t) not in arg_keys else t
                   for t in leaves]
        with self.segments.paused():  # eager segments: the step refreshes them at replay
            for target, t in zip(targets, leaves, strict=True):
                if target is not t and not (target.is_cuda and torch.cuda.is_current_stream_capturing()):
                    target.copy_(t)
        return targets

    def add_step(self, step: Action, held: Any) -> None:
        """The replay work of the break just run, and what it must keep alive."""
        self.steps.append(step)
        self.held.append(held)

    def finish(self, output: Any, finalize: Callable[[Any], Any]) -> Any:
        """Apply the output policy inside the last segment; returns the static output."""
        return finalize(output)


_active: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar("sglang_bcg_recorder", default=None)


def active_recorder() -> Recorder | None:
    """The recorder of the segmented capture running in this context, if any."""
    return _active.get()


def record(recorder: Recorder, forward_fn: Callable[[], Any], finalize: Callable[[Any], Any]) -> SegmentedGraph:
    """Run ``forward_fn`` with ``recorder`` active; returns the captured graph (any failure aborts
    every segment). :raises HostReadError: a host read inside a segment."""
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
    return SegmentedGraph(recorder.key, recorder.segments, recorder.steps, output, recorder.held)
