"""The Piecewise front of the segment recorder: one segment per stretch between splitting calls, which
run eagerly; what crosses a split passes as it is (docs/piecewise.md#values-crossing-a-splitting-op)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from ...engines.base import Front
from ...engines.recorder import Recorder, Rerun, Segments, active_recorder
from ...output.released import maybe_alias
from ...output.trees import flatten, storage_key, unflatten


def active_piece_recorder() -> PieceRecorder | None:
    """The recorder of the piecewise capture running in this context, if any."""
    rec = active_recorder()
    return rec if isinstance(rec, PieceRecorder) else None


def _tensors(tree: object) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


class PieceRecorder(Recorder):
    """Records the pieces and splitting calls of one key (set active while its forward runs)."""

    def __init__(self, key: object, segments: Segments,
                 static_inputs: frozenset[tuple[str, int]] = frozenset()) -> None:
        super().__init__(key, segments)
        self.inputs: set[tuple[str, int]] = set(static_inputs)
        self.graph_calls = 0

    def note_inputs(self, args: tuple[Any, ...]) -> None:
        self.graph_calls += 1
        self.inputs.update(storage_key(t) for t in _tensors(args))
        self.held.append(args)

    def run_piece(self, tag: str, fn: Callable[[list[Any]], Any], args: list[Any]) -> Any:
        """Run a piece boxed (``fn`` empties ``args``); on the eager segments, record its re-run."""
        if self.in_break or not self.segments.reruns_actions:  # CUDA: the kernels are in the graph
            return fn(args)
        kept = tuple(args)  # eager segments: the re-run holds its arguments and outputs
        with self.segments.watched():  # a host read in a piece: its CUDA graph would replay the value
            result = fn(args)
        self.segments.record(Rerun(tag, lambda *a: fn(list(a)), kept, {}, tree_leaves(result)))
        return result

    def run_split(self, tag: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        if self.in_break:
            return fn(*args)
        in_args = {storage_key(t) for t in _tensors(args)}
        with self.eager_break():
            result = fn(*args)
        leaves, spec = tree_flatten(result)
        targets = self.fresh_returns(leaves, in_args)
        kept = tuple(maybe_alias(a) for a in args)
        rets = [maybe_alias(t) for t in targets]
        self.add_step(Rerun(tag, fn, kept, {}, rets), kept)  # strong: what was not aliased
        return tree_unflatten(targets, spec)

    def finish(self, output: Any, finalize: Callable[[Any], Any]) -> Any:
        """The output policy inside the last segment. :raises RuntimeError: no compiled callable ran."""
        if self.graph_calls == 0:
            raise RuntimeError(f"forward_fn of {self.key!r} never called a callable compiled by this backend; pass a "
                               "forward that calls backend.compile(model)(...)")
        node, leaves = flatten(output)  # an input returned is the caller's: the output owns a copy
        owned = [t.clone() if storage_key(t) in self.inputs else t for _, t in leaves]
        return finalize(unflatten(node, owned))


class PieceFront(Front):
    """The Piecewise front of the segmented engine: a :class:`PieceRecorder` per key, no bridges."""

    min_cuda_warmups = 1

    def recorder(self, key: object, segments: Segments, partition: int | None,
                 static_inputs: frozenset[tuple[str, int]]) -> PieceRecorder:
        return PieceRecorder(key, segments, static_inputs)
