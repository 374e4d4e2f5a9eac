"""The eager engine's segments: an op tape, the CPU stand-in of a CUDA stream capture.

While a segment is open, a dispatch mode (:class:`_Tape`) records every op the forward runs,
with the very tensors it ran on; replay runs the same ops again on those tensors and writes
each result into the tensor captured for it (:func:`~.recorder.refresh`), as a graph replay
rewrites the memory it owns. So work around the breaks or pieces — ``fn(x[:n] * 2)``,
``fn(x) * 2``, the output policy's copies — replays on CPU exactly as on CUDA, and only ops
replay: the forward's Python runs once, at capture, as with a CUDA graph.

Allocations replay no work (a graph has no kernel for them either). Work whose replay is
recorded another way (a compiled callable's pieces, a break's own result) runs inside
:meth:`EagerSegments.paused`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .recorder import Action, refresh

#: Ops that only allocate: a CUDA graph replays no kernel for them, so neither does the tape.
_ALLOCATIONS = frozenset(
    getattr(torch.ops.aten, name).default if name != "empty" else torch.ops.aten.empty.memory_format
    for name in ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided")
)


class _OpStep:
    """One recorded op: run it again on the captured arguments, refresh the captured outputs."""

    __slots__ = ("func", "args", "kwargs", "outs")

    def __init__(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        self.func, self.args, self.kwargs = func, args, kwargs
        self.outs = [t if isinstance(t, torch.Tensor) else None for t in tree_leaves(out)]

    def __call__(self) -> None:
        new = tree_leaves(self.func(*self.args, **self.kwargs))
        for static, value in zip(self.outs, new, strict=True):
            if static is not None:
                refresh(static, value, f"op {self.func}")


class _Tape(TorchDispatchMode):
    """Records every op run while a segment of the eager engine is open: the eager stand-in of a
    CUDA stream capture. Work the forward does around the breaks or pieces (``fn(x[:n] * 2)``,
    ``fn(x) * 2``, the output policy's copies) is replayed as a graph would replay it."""

    def __init__(self, sink: list[Action]) -> None:
        super().__init__()
        self.sink = sink

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func not in _ALLOCATIONS:
            self.sink.append(_OpStep(func, args, kwargs, out))
        return out


class EagerSegments:
    """Segments of the eager engine: the ops run while a segment is open (recorded by a
    dispatch mode, as a CUDA stream capture records kernels) and the actions front-ends record
    (piece re-runs), re-run in order at replay. Only ops are recorded: Python logic of the forward
    runs once, at capture, exactly as with a CUDA graph."""

    #: Recorded actions are re-run at replay: what they read must be kept.
    reruns_actions = True

    def __init__(self) -> None:
        self._done: list[list[Action]] = []
        self._current: list[Action] | None = None
        self._tape: _Tape | None = None
        self._pauses = 0  # a break inside a paused call (a splitting op) reopens no tape

    def _start(self) -> None:
        if self._current is not None and self._pauses == 0 and self._tape is None:
            self._tape = _Tape(self._current)
            self._tape.__enter__()

    def _stop(self) -> None:
        tape, self._tape = self._tape, None
        if tape is not None:
            tape.__exit__(None, None, None)

    def begin(self) -> None:
        self._current = []
        self._start()

    def end(self) -> None:
        self._stop()
        assert self._current is not None
        self._done.append(self._current)
        self._current = None

    def record(self, action: Action) -> None:
        assert self._current is not None
        self._current.append(action)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self._stop()
        self._pauses += 1
        try:
            yield
        finally:
            self._pauses -= 1
            self._start()

    def abort(self) -> None:
        self._stop()
        self._current = None
        self._done.clear()

    def runners(self) -> list[Action | None]:
        return [functools.partial(_run_all, acts) if acts else None for acts in self._done]

    def release(self) -> None:
        self._done.clear()


def _run_all(actions: list[Action]) -> None:
    for action in actions:
        action()
