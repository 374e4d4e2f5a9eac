"""Recording one shape key of a piecewise-compiled forward: the Piecewise front.

A capture of key K is ``segment, op, segment, op, ..., segment``: one *segment* per stretch
between splitting calls (``k`` calls give ``k + 1`` segments), the splitting ops run eagerly
between them. On CUDA a segment is one ``torch.cuda.CUDAGraph`` that stays open across the
piece(s) it holds and, for the last one, across the output policy (``finalize``), so the
sharing copy is recorded inside the last piece's graph. On the eager engine a segment is the
piece re-runs plus the op tape of the work around them. Opening, closing, aborting and replaying
segments is the shared segment recorder's job (:mod:`sglang_bcg_plugin.engines.recorder`); this
module is its piecewise front: what crosses a piece boundary and where it lives.

Zero-copy (``docs/piecewise.md``, "Values crossing a splitting op"), the Breakable rule:

* a piece's outputs pass to the next piece or splitting call **as they are**: graph-pool memory
  that this key's piece writes at every replay. Nothing is copied and nothing is held by the
  recorder, so the pool reuses a value's blocks once the program drops it, exactly as a
  whole-forward graph reuses its dead intermediates;
* a splitting call's replay step keeps its tensor arguments through *non-owning aliases*
  (:func:`~sglang_bcg_plugin.released.maybe_alias`) on CUDA. At replay it reads them between the
  same two segments as at capture, after this key's own pieces wrote them; nothing in between
  can have overwritten them, since at capture they were alive (the program still held them), so
  the allocator gave their blocks to nothing that runs in between;
* a tensor a splitting call returns (allocated by it, outside the graphs) gets graph-pool memory
  of its own: an empty tensor like it, allocated as the first thing of the next segment, which
  the program receives (the step refreshes it at every replay, through an alias). A return that
  aliases an argument is stable already and passed as is;
* on the eager segments (CPU) nothing is captured: the returned values are copied at once and
  references stay strong (CPU memory is not a graph pool).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from ...engines.recorder import Recorder, Segments, active_recorder, refresh
from ...released import maybe_alias
from ...trees import flatten, storage_key, unflatten


def active_piece_recorder() -> PieceRecorder | None:
    """The recorder of the piecewise capture running in this context, if any."""
    rec = active_recorder()
    return rec if isinstance(rec, PieceRecorder) else None


def _tensors(tree: object) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _rerun(tag: str, fn: Callable[..., Any], args: tuple[Any, ...], targets: list[Any]) -> None:
    """Replay of a piece (eager engine) or splitting call: run again, refresh the targets."""
    new = tree_leaves(fn(*args))
    for target, value in zip(targets, new, strict=True):
        if isinstance(target, torch.Tensor):
            refresh(target, value, tag)


class PieceRecorder(Recorder):
    """Records the pieces and splitting calls of one key (set active while its forward runs)."""

    def __init__(self, key: object, segments: Segments, static_inputs: frozenset[tuple[str, int]] = frozenset()) -> None:
        super().__init__(key, segments)
        self.inputs: set[tuple[str, int]] = set(static_inputs)
        self.graph_calls = 0

    # -- called by the compiled program -------------------------------------------------------
    def note_inputs(self, args: tuple[Any, ...]) -> None:
        self.graph_calls += 1
        self.inputs.update(storage_key(t) for t in _tensors(args))
        self.held.append(args)

    def run_piece(self, tag: str, fn: Callable[[list[Any]], Any], args: list[Any]) -> Any:
        """Run a piece *boxed*: ``fn`` empties ``args``, so on CUDA an argument the piece
        consumes early is freed inside its graph (the pool reuses it), as in a whole graph."""
        if self.in_break or not self.segments.reruns_actions:
            # inside a splitting op: nothing to record. CUDA: the kernels are in the open graph.
            return fn(args)
        kept = tuple(args)  # eager segments: the re-run holds its arguments and outputs (CPU
        result = fn(args)  # memory, not a pool)
        self.segments.record(functools.partial(_rerun, tag, lambda *a: fn(list(a)), kept, tree_leaves(result)))
        return result

    def run_split(self, tag: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        if self.in_break:
            return fn(*args)
        in_args = {storage_key(t) for t in _tensors(args)}
        with self.eager_break():
            result = fn(*args)
        leaves, spec = tree_flatten(result)
        # The next segment is open: returned tensors get pool memory as its first allocations.
        targets = [
            torch.empty_like(t) if isinstance(t, torch.Tensor) and storage_key(t) not in in_args else t
            for t in leaves
        ]
        with self.segments.paused():  # eager segments: the step refreshes them at replay
            for target, t in zip(targets, leaves, strict=True):
                if target is not t and not _capturing(target):
                    target.copy_(t)
        kept = tuple(maybe_alias(a) for a in args)
        rets = [maybe_alias(t) for t in targets]
        self.add_step(functools.partial(_rerun, tag, fn, kept, rets), kept)  # strong: what was not aliased
        return tree_unflatten(targets, spec)

    # -- called by the engine -----------------------------------------------------------------
    def finish(self, output: Any, finalize: Callable[[Any], Any]) -> Any:
        """Apply the output policy inside the last segment; returns the static output.

        Work the forward does outside the compiled callable (before it, ``fn(x[:n] * 2)``, or
        after it, ``fn(x) * 2``) is in the open segments like the pieces' work: captured on CUDA,
        on the eager segments' op tape otherwise; so is the output policy's copy.

        :raises RuntimeError: the forward never ran a compiled callable.
        """
        if self.graph_calls == 0:
            msg = (
                f"forward_fn of {self.key!r} never called a callable compiled by this backend; "
                "pass a forward that calls backend.compile(model)(...)"
            )
            raise RuntimeError(msg)
        node, leaves = flatten(output)
        # Inputs are the caller's: the output owns a copy (recorded in the last segment).
        owned = [t.clone() if storage_key(t) in self.inputs else t for _, t in leaves]
        return finalize(unflatten(node, owned))


class PieceFront:
    """The Piecewise front of the segmented engine: a :class:`PieceRecorder` per key; values
    crossing a split pass as they are (no bridges). On CUDA a warmup must run first (it compiles)."""

    min_cuda_warmups = 1

    def recorder(
        self, key: object, segments: Segments, partition: int | None, static_inputs: frozenset[tuple[str, int]]
    ) -> PieceRecorder:
        return PieceRecorder(key, segments, static_inputs)

    def bridge_bytes(self) -> dict[int | None, int]:
        return {}

    def release(self) -> None:
        """Nothing held between keys."""
