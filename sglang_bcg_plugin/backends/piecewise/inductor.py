"""Inductor for the pieces (``inductor=True``): one dynamic compilation per piece, on fake inputs with
dynamo's symbolic sizes; Inductor's own CUDA graphs stay off (docs/piecewise.md#inductor-pieces-inductortrue)."""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ...output.trees import storage_key

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
    """Non-overlapping and dense (``torch.empty_like`` keeps its strides); undecidable: no."""
    check = getattr(torch._prims_common, "is_non_overlapping_and_dense_or_false", None)
    if check is None:  # pragma: no cover - older torch: only the contiguous layout counts
        return _contiguous(t)
    return bool(check(t))


def dense_fresh(result: Any, args: Sequence[Any]) -> Any:
    """``result`` with every tensor that aliases no argument and has gaps or overlaps made contiguous,
    so a compiled piece meets one layout at capture and outside it; dense returns pass as they are."""
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


class CompiledPiece(NamedTuple):
    """A piece compiled by Inductor, returning what the FX piece returned (a tuple, or one value)."""

    compiled: Callable[[list[Any]], Any]
    returns_tuple: bool

    def boxed(self, args: list[Any]) -> Any:
        """Run on ``args``, a list Inductor's boxed code empties (it frees each input after its last use)."""
        out = self.compiled(args)
        return tuple(out) if self.returns_tuple else out[0]


class InductorPieces:
    """Compiles the pieces of split graphs with Inductor (``config``: extra patches); counts them.
    :raises ValueError: ``config`` turns ``triton.cudagraphs`` on."""

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        extra = dict(config or {})
        if extra.get("triton.cudagraphs"):
            msg = "inductor_config: triton.cudagraphs must stay off (the backend captures the pieces itself)"
            raise ValueError(msg)
        self.config = {**extra, "triton.cudagraphs": False}  # we capture the pieces, Inductor must not
        self.num_compilations, self.seconds = 0, 0.0

    def compile(self, split_gm: torch.fx.GraphModule, example_inputs: Sequence[Any], pieces: Collection[str],
                dense: Collection[str]) -> dict[str, CompiledPiece]:
        """Compile the sub-modules ``pieces`` of ``split_gm``; the fresh returns of the splitting calls
        ``dense`` are made dense (:func:`dense_fresh`)."""
        from torch._guards import detect_fake_mode

        start = time.perf_counter()
        # dynamo's fake value of every input, from the tracing context's fake mode (the placeholders'
        # ``example_value`` may be in another one)
        fake_mode = detect_fake_mode(list(example_inputs))
        if fake_mode is None:
            msg = "compiling pieces with Inductor needs dynamo's fake mode; call the backend from torch.compile"
            raise RuntimeError(msg)
        fake = [fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]
        run = _FakeRun(split_gm, self, frozenset(pieces), frozenset(dense))
        run.run(*fake)
        self.seconds += time.perf_counter() - start
        return run.compiled

    def compile_piece(self, piece: torch.fx.GraphModule, fake_args: Sequence[Any]) -> CompiledPiece:
        """One Inductor compilation of ``piece`` for ``fake_args`` (symbolic sizes)."""
        from torch._inductor.compile_fx import compile_fx

        gm = copy.deepcopy(piece)  # compile_fx may rewrite the graph; the FX piece stays as traced
        out = next(n for n in gm.graph.nodes if n.op == "output")
        returns_tuple = isinstance(out.args[0], (tuple, list))
        if not returns_tuple:  # one value returned as a 1-tuple: a boxed compile expects tuples
            out.args = ((out.args[0],),)
            gm.recompile()
        # wrapped, compile_fx returns a boxed callable (one list, emptied)
        boxed = torch._dynamo.utils.GmWrapper(gm, tuple)
        # torch's annotation says GraphModule; a GmWrapper is how compile_fx is asked for a boxed callable
        compiled = compile_fx(boxed, list(fake_args), config_patches=dict(self.config))  # type: ignore[arg-type]
        self.num_compilations += 1
        return CompiledPiece(compiled, returns_tuple)  # type: ignore[arg-type]


class _FakeRun(torch.fx.Interpreter):
    """Runs the split graph on fake values; compiles each piece with the fake args it receives."""

    def __init__(self, module: torch.fx.GraphModule, owner: InductorPieces, pieces: frozenset[str],
                 dense: frozenset[str]) -> None:
        super().__init__(module)
        self.owner, self.pieces, self.dense = owner, pieces, dense
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
