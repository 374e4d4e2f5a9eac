"""The eager engine's segments: an op tape (a dispatch mode recording every op run while a segment
is open, replayed on the captured tensors), the CPU stand-in of a CUDA stream capture; a host read
inside a segment raises :class:`~sglang_bcg_plugin.errors.HostReadError` (docs/refusals.md), in the
body of a custom op and in the pieces of a compiled model too."""

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

#: Namespaces of torch's own ops, whose kernels the tape's tags describe. Any other op (a
#: ``torch.library`` custom op) reaches the tape whole: its body is watched for host reads.
_TORCH_NAMESPACES = frozenset({"aten", "prims", "prim"})

#: Where a custom op's body runs: below the Python key, so the ops it calls come back to the modes.
_BELOW_PYTHON = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.Python)

#: Ops that only allocate: a CUDA graph replays no kernel for them, so neither does the tape.
_ALLOCATIONS = frozenset(
    getattr(_aten, name).default if name != "empty" else _aten.empty.memory_format
    for name in ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided")
)

#: Tensor methods that read values without dispatching an op the tape sees (seen by a function
#: mode): printing runs with the dispatch modes off; ``.cpu()`` is a host copy (on CUDA a sync).
_PY_READS = {
    torch.Tensor.tolist: "Tensor.tolist()",
    torch.Tensor.numpy: "Tensor.numpy()",
    torch.Tensor.__array__: "Tensor.__array__ (numpy.asarray)",
    torch.Tensor.__repr__: "printing a tensor (print(t), str(t), repr(t) read its values)",
    torch.Tensor.__format__: "formatting a tensor (f'{t}' reads its values)",
    torch.Tensor.cpu: "Tensor.cpu() (a copy to the host: on CUDA a sync a stream capture refuses)",
}

#: The kernel of an aten op made of others (:func:`_composite`).
_IMPLICIT = torch._C.DispatchKey.CompositeImplicitAutograd


def _reads_host(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """What ``func`` reads on the host (a value, or a value-dependent output shape), or ``None``."""
    tags = getattr(func, "tags", ())
    if torch.Tag.data_dependent_output in tags:
        if func in (_aten._local_scalar_dense.default, _aten.item.default):  # item: reached whole below autograd
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


def _body_keys(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch._C.DispatchKeySet | None:
    """The keys to run custom op ``func``'s body with below the Python key (its tensors' backend), or
    ``None`` for torch's own ops, ops without tensor arguments and tensor subclasses that dispatch
    in Python themselves (run as they are)."""
    if not isinstance(func, torch._ops.OpOverload) or func.namespace in _TORCH_NAMESPACES:
        return None
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if not tensors:
        return None
    keys = torch._C._dispatch_keys(tensors[0])
    for t in tensors[1:]:
        keys = keys | torch._C._dispatch_keys(t)
    return None if keys.has(torch._C.DispatchKey.Python) else keys & _BELOW_PYTHON


def _composite(func: Any) -> bool:
    """Whether ``func`` is an aten op made of others (``is_nonzero``, ``reshape``). Autograd
    decomposes it before the tape, except where autograd is off for its tensors (inference
    tensors) or below it (a custom op's body): then its parts are what read the host."""
    return (isinstance(func, torch._ops.OpOverload) and func.namespace in _TORCH_NAMESPACES
            and torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), _IMPLICIT))


class _Tape(TorchDispatchMode):
    """Records every op run while an eager segment is open (``sink``; ``None``: only refuses host
    reads, as around a compiled piece or inside a custom op's body)."""

    def __init__(self, sink: list[Action] | None, refuse: Any) -> None:
        super().__init__()
        self.sink, self.refuse = sink, refuse
        self.validating = 0  # inside a call whose host reads only validate (see _validates_only)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        read = _reads_host(func, args, kwargs)
        if read is not None and not self.validating:
            self.refuse(read)
        keys = _body_keys(func, args, kwargs)
        if keys is not None:  # a custom op's body reads like the forward's own code: a capture refuses it too
            with self.watch():
                out = func.redispatch(keys, *args, **kwargs)
        elif _composite(func):  # reached whole (inference tensors, a custom op's body): watch its parts
            # its C++ kernel (a Python one may call func again) calls no Python: no function mode
            with self.watch(functions=False), torch._C.DisableTorchFunction():
                out = func._op_dk(_IMPLICIT, *args, **kwargs)
        else:
            out = func(*args, **kwargs)
        if self.sink is not None and func not in _ALLOCATIONS:
            self.sink.append(Rerun(f"op {func}", func, args, kwargs, tree_leaves(out)))
        return out

    @contextlib.contextmanager
    def watch(self, functions: bool = True) -> Iterator[None]:
        """Refuse the host reads of the work in the body (nothing recorded): a dispatch mode and (with
        ``functions``) its function mode, pushed anew (a mode is off while its own handler runs)."""
        inner = _Tape(None, self.refuse)
        inner.validating = self.validating
        with _PyReads(inner) if functions else contextlib.nullcontext(), inner:
            yield


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

    def watched(self) -> contextlib.AbstractContextManager[None]:
        """Refuse host reads in the body, recording nothing (work replayed another way, a compiled
        piece: a CUDA graph would hold it); nothing to watch outside an open segment."""
        return contextlib.nullcontext() if self._current is None else _Tape(None, self._refuse).watch()

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
