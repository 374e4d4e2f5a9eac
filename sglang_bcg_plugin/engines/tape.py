"""The eager engine's segments: an op tape (a dispatch mode recording every op run while a segment
is open, replayed on the captured tensors), the CPU stand-in of a CUDA stream capture; a host read
inside a segment raises :class:`~sglang_bcg_plugin.errors.HostReadError` (docs/refusals.md)."""

from __future__ import annotations

import contextlib
import functools
import traceback
from collections.abc import Iterator
from typing import Any, NoReturn

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..errors import HostReadError, user_frame
from .recorder import Action, Rerun

_aten = torch.ops.aten
#: Ops that only allocate: a CUDA graph replays no kernel for them, so neither does the tape.
_ALLOCATIONS = frozenset(
    getattr(_aten, name).default if name != "empty" else _aten.empty.memory_format
    for name in ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided")
)

#: Tensor methods that read values without dispatching an op (seen by a function mode).
_PY_READS = {
    torch.Tensor.tolist: "Tensor.tolist()",
    torch.Tensor.numpy: "Tensor.numpy()",
    torch.Tensor.__array__: "Tensor.__array__ (numpy.asarray)",
}


def _reads_host(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """What ``func`` reads on the host (a value, or a value-dependent output shape), or ``None``."""
    tags = getattr(func, "tags", ())
    if torch.Tag.data_dependent_output in tags:
        if func is _aten._local_scalar_dense.default:
            return f"{func} (.item(), bool(t), int(t), float(t), `if t:`)"
        return str(func)
    if torch.Tag.dynamic_output_shape not in tags:
        return None
    if func is _aten.index.Tensor:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices):
            return f"{func} with a boolean mask (x[mask]): its output shape depends on the mask's values"
        return None
    if func is _aten.repeat_interleave.Tensor and kwargs.get("output_size") is not None:
        return None
    return f"{func}: its output shape depends on the values"


def _validates_only(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``func``'s host reads only validate its arguments (``one_hot`` given ``num_classes``)."""
    return func is torch.nn.functional.one_hot and (args[1] if len(args) > 1 else kwargs.get("num_classes", -1)) != -1


class _Tape(TorchDispatchMode):
    """Records every op run while an eager segment is open."""

    def __init__(self, sink: list[Action], refuse: Any) -> None:
        super().__init__()
        self.sink, self.refuse = sink, refuse
        self.validating = 0  # inside a call whose host reads only validate (see _validates_only)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        read = _reads_host(func, args, kwargs)
        if read is not None and not self.validating:
            self.refuse(read)
        out = func(*args, **kwargs)
        if func not in _ALLOCATIONS:
            self.sink.append(Rerun(f"op {func}", func, args, kwargs, tree_leaves(out)))
        return out


class _PyReads(TorchFunctionMode):
    """Refuses the tensor methods that read values without an op (``.tolist()``, ``.numpy()``)."""

    def __init__(self, tape: _Tape) -> None:
        super().__init__()
        self.tape = tape

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        read = _PY_READS.get(func)
        if read is not None:
            self.tape.refuse(read)
        if not _validates_only(func, args, kwargs):
            return func(*args, **kwargs)
        self.tape.validating += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.tape.validating -= 1


class EagerSegments:
    """Segments of the eager engine: recorded ops and front-end actions, re-run in order at replay."""

    reruns_actions = True

    def __init__(self, key: object = None) -> None:
        self.key = key
        self._done: list[list[Action]] = []
        self._current: list[Action] | None = None
        self._modes: contextlib.ExitStack | None = None  # the tape and its function mode, if open
        self._pauses = 0  # a break inside a paused call (a splitting op) reopens no tape
        self._refused: HostReadError | None = None

    def _refuse(self, op: str) -> NoReturn:
        """Raise for a host read inside the open segment (failed even if the forward catches it)."""
        where = user_frame([(f.filename, f.lineno or 0, f.name) for f in traceback.extract_stack()])
        self._refused = HostReadError(self.key, len(self._done), op, where)
        raise self._refused

    def _start(self) -> None:
        if self._current is not None and self._pauses == 0 and self._modes is None:
            tape = _Tape(self._current, self._refuse)
            self._modes = contextlib.ExitStack()
            self._modes.enter_context(_PyReads(tape))
            self._modes.enter_context(tape)

    def _stop(self) -> None:
        modes, self._modes = self._modes, None
        if modes is not None:
            modes.close()

    def begin(self) -> None:
        self._current = []
        self._start()

    def end(self) -> None:
        self._stop()
        if self._refused is not None:
            raise self._refused
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
