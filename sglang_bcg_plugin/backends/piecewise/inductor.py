"""Inductor for the pieces (vLLM's piecewise design): one dynamic compilation per piece.

With ``inductor=True`` the compile backend hands every *piece* of the split graph (never a
splitting call, which stays eager) to Inductor's ``compile_fx`` before wrapping it in its
runner. Inductor fuses the piece's pointwise and reduction work, so the CUDA graph captured
from it launches fewer, cheaper kernels and holds fewer intermediates in the pool.

One artifact per piece serves every capture size: the pieces are compiled with *fake* example
inputs carrying dynamo's symbolic sizes (dynamo's fake tensor of each graph input, propagated
through the split graph by :class:`_FakeRun` under dynamo's ``FakeTensorMode``), so no size is
baked in. Inductor's own CUDA graphs stay off (``triton.cudagraphs=False``): we
capture the compiled pieces ourselves.

Layouts: a compiled piece checks the strides of its inputs (they were fixed at compile time).
A piece's outputs cross a splitting call as they are, in the layout Inductor gives them (the
eager strides: a transposed query stays transposed, so the attention reads it without a copy).
A tensor a splitting call returns reaches the next piece, at capture, through graph-pool memory
made by ``torch.empty_like``, which keeps the strides of a dense layout (a permutation) but not
of one with gaps or overlaps. So every such fresh return is made contiguous (:func:`dense_fresh`)
in the fake run *and* in every plain call, and the compiled pieces see one layout, outside a
capture and inside one; a dense return, transposed or not, is never copied.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ...trees import storage_key

#: Inductor settings the pieces always get: we capture them, Inductor must not.
FORCED_CONFIG: Mapping[str, Any] = {"triton.cudagraphs": False}


def _fresh_key(t: torch.Tensor) -> object:
    """Storage identity that also works for fake tensors (no data pointer there)."""
    if isinstance(t, torch._subclasses.FakeTensor):
        return torch.multiprocessing.reductions.StorageWeakRef(t.untyped_storage())
    return storage_key(t)


def _contiguous(t: torch.Tensor) -> bool:
    """Contiguous for every size (a fake tensor's unbacked size may not be decidable: no)."""
    check = getattr(torch._prims_common, "is_contiguous_or_false", None)
    if check is None or not isinstance(t, torch._subclasses.FakeTensor):  # real sizes: the C++ check
        return bool(t.is_contiguous())
    return bool(check(t))


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense (a permutation of a contiguous layout): ``torch.empty_like``
    gives the same strides. Undecidable for a fake tensor's unbacked size: no."""
    check = getattr(torch._prims_common, "is_non_overlapping_and_dense_or_false", None)
    if check is None:  # pragma: no cover - older torch: only the contiguous layout counts
        return _contiguous(t)
    return bool(check(t))


def dense_fresh(result: Any, args: Sequence[Any]) -> Any:
    """``result`` with every tensor that aliases no argument and has gaps or overlaps made contiguous.

    A splitting call's fresh return reaches the next piece, at capture, through
    ``torch.empty_like`` pool memory: the same strides for a dense layout, contiguous ones
    otherwise. Done outside a capture too, so a compiled piece meets one layout everywhere. A
    dense return (contiguous, transposed, any permutation) passes as it is, never copied.
    """
    leaves, spec = tree_flatten(result)
    if all(not isinstance(t, torch.Tensor) or _dense(t) for t in leaves):
        return result
    inputs = {_fresh_key(a) for a in tree_flatten(list(args))[0] if isinstance(a, torch.Tensor)}
    out = [
        t.clone(memory_format=torch.contiguous_format)
        if isinstance(t, torch.Tensor) and not _dense(t) and _fresh_key(t) not in inputs
        else t
        for t in leaves
    ]
    return tree_unflatten(out, spec)


class CompiledPiece:
    """A piece compiled by Inductor, returning what the FX piece returned.

    Called *boxed* (``piece.boxed(args)``, one list) where the caller holds no other reference to
    the arguments: Inductor's code empties the list and drops each input after its last use, so
    a value the piece consumes early (the attention output before ``o_proj``) is freed inside
    the piece, as a whole-model graph frees it, instead of living until the piece returns.
    Inductor returns a list for a graph that returns a tuple; the recorder and the split graph
    expect the piece's own structure, so a tuple is given back (one value stays one value).

    :param compiled: Inductor's callable; takes one list when ``boxed``, the arguments otherwise.
    :param returns_tuple: the FX piece returns a tuple (else its one value was made a 1-tuple
        for Inductor).
    """

    def __init__(self, compiled: Callable[..., Any], returns_tuple: bool, boxed: bool = False) -> None:
        self.compiled = compiled
        self.returns_tuple = returns_tuple
        self.is_boxed = boxed

    def boxed(self, args: list[Any]) -> Any:
        """Run on ``args`` (a list this call empties when Inductor's code is boxed)."""
        if self.is_boxed:
            out = self.compiled(args)
        else:
            out = self.compiled(*args)
            args.clear()
        return tuple(out) if self.returns_tuple else out[0]

    def __call__(self, *args: Any) -> Any:
        return self.boxed(list(args))


def _returns_tuple(gm: torch.fx.GraphModule) -> bool:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return isinstance(out.args[0], (tuple, list))


def _as_tuple_graph(gm: torch.fx.GraphModule) -> None:
    """Make ``gm`` (a copy) return its one value as a 1-tuple: a boxed compile expects tuples."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    out.args = ((out.args[0],),)
    gm.recompile()


def _boxed_module(gm: torch.fx.GraphModule) -> torch.nn.Module | None:
    """``gm`` wrapped so that ``compile_fx`` returns a boxed callable (one list, emptied), or
    ``None`` where this torch has no such wrapper."""
    wrapper = getattr(torch._dynamo.utils, "GmWrapper", None)
    if wrapper is None:  # pragma: no cover - torch < 2.4
        return None
    return wrapper(gm, tuple)  # type: ignore[no-any-return]


class InductorPieces:
    """Compiles the pieces of split graphs with Inductor; counts compilations and their seconds.

    :param config: extra Inductor config patches (``torch._inductor.config`` names, e.g.
        ``{"max_autotune": True}``); ``triton.cudagraphs`` is always ``False``.
    """

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        extra = dict(config or {})
        if extra.get("triton.cudagraphs"):
            msg = "inductor_config: triton.cudagraphs must stay off (the backend captures the pieces itself)"
            raise ValueError(msg)
        self.config = {**extra, **FORCED_CONFIG}
        self.num_compilations = 0
        self.seconds = 0.0

    def compile(
        self,
        split_gm: torch.fx.GraphModule,
        example_inputs: Sequence[Any],
        pieces: Collection[str],
        dense: Collection[str],
    ) -> dict[str, CompiledPiece]:
        """Compile the sub-modules ``pieces`` of ``split_gm`` (before they are wrapped).

        :param example_inputs: what dynamo passed the compile backend (one per placeholder).
        :param dense: the splitting calls: their fresh returns with gaps are made contiguous
            (see module doc).
        """
        start = time.perf_counter()
        run = _FakeRun(split_gm, self, frozenset(pieces), frozenset(dense))
        run.run(*_fake_inputs(example_inputs))
        self.seconds += time.perf_counter() - start
        return run.compiled

    def compile_piece(self, piece: torch.fx.GraphModule, fake_args: Sequence[Any]) -> CompiledPiece:
        """One Inductor compilation of ``piece`` for ``fake_args`` (symbolic sizes)."""
        from torch._inductor.compile_fx import compile_fx

        gm = copy.deepcopy(piece)  # compile_fx may rewrite the graph; the FX piece stays as traced
        returns_tuple = _returns_tuple(gm)
        if not returns_tuple:
            _as_tuple_graph(gm)
        boxed = _boxed_module(gm)
        compiled = compile_fx(gm if boxed is None else boxed, list(fake_args), config_patches=dict(self.config))
        self.num_compilations += 1
        return CompiledPiece(compiled, returns_tuple, boxed=boxed is not None)  # type: ignore[arg-type]


def _fake_inputs(example_inputs: Sequence[Any]) -> list[Any]:
    """Dynamo's fake value of every example input: tensors with symbolic sizes, SymInts as is.

    The tracing context's fake mode memoizes the fake tensor dynamo made of each real input
    (marked dynamic, so its size is a symbol); the placeholders' ``example_value`` may live in
    another fake mode (torch >= 2.13 re-fakes them for the backend), which Inductor rejects.
    """
    from torch._guards import detect_fake_mode

    fake_mode = detect_fake_mode(list(example_inputs))
    if fake_mode is None:
        msg = "compiling pieces with Inductor needs dynamo's fake mode; call the backend from torch.compile"
        raise RuntimeError(msg)
    return [fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]


class _FakeRun(torch.fx.Interpreter):
    """Runs the split graph on fake values; compiles each piece with the fake args it receives."""

    def __init__(
        self, module: torch.fx.GraphModule, owner: InductorPieces, pieces: frozenset[str], dense: frozenset[str]
    ) -> None:
        super().__init__(module)
        self.owner = owner
        self.pieces = pieces
        self.dense = dense
        self.compiled: dict[str, CompiledPiece] = {}

    def run(self, *args: Any, **kwargs: Any) -> Any:
        from torch._dispatch.python import enable_python_dispatcher
        from torch._guards import detect_fake_mode

        # Dynamo's fake mode (from the fake args): the sizes stay symbolic through every piece.
        with detect_fake_mode(list(args)) or contextlib.nullcontext(), enable_python_dispatcher():
            return super().run(*args, **kwargs)

    def call_module(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        out = super().call_module(target, args, kwargs)
        if target in self.pieces:
            self.compiled[target] = self.owner.compile_piece(self.fetch_attr(target), args)
        return dense_fresh(out, args) if target in self.dense else out
