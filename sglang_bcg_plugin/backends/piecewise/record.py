"""Recording one shape key of a piecewise-compiled forward.

A capture of key K is ``segment, op, segment, op, ..., segment``: one *segment* per stretch
between splitting calls (``k`` calls give ``k + 1`` segments), the splitting ops run eagerly
between them. On CUDA a segment is one ``torch.cuda.CUDAGraph`` that stays open across the
piece(s) it holds and, for the last one, across the output policy (``finalize``), so the
sharing copy is recorded inside the last piece's graph. On the eager engine a segment is the list
of piece re-runs to repeat at replay. Opening, closing, aborting and replaying segments is the
shared segment recorder's job (:mod:`sglang_bcg_plugin.engines.recorder`); this module is its
piecewise front-end: what crosses a piece boundary and where it lives.

Stable addresses across pieces (the next piece's graph reads them):

* fresh outputs of a piece followed by a splitting op are copied into slots of the partition's
  bridge :class:`~sglang_bcg_plugin.storage.SlotStore` (inside its graph), so the piece's
  own output memory returns to the pool; so are a splitting op's fresh outputs (eagerly);
* outputs that alias an input (views, in-place ops) already have a stable address: passed as is;
* slots are *registers* (:class:`Registers`): reused by a later value once the last reader of
  every value in them has run (:class:`Lifetimes`, from the split graph), so the store holds the
  values live at once, not one slot per call site; keys running the same calls name the same
  registers, so every key of a partition shares them. Registers are storage, not rows: one per
  (dtype, device) and number, whatever the value's shape;
* everything crossing a boundary is held by strong reference for the life of the graph (weak
  references let later captures re-carve the memory: SGLang #37606).
"""

from __future__ import annotations

import functools
import heapq
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from ...engines.recorder import Recorder, Segments, active_recorder, refresh
from ...storage import PartitionStores, SlotStore
from ...trees import flatten, storage_key, unflatten


def active_piece_recorder() -> PieceRecorder | None:
    """The recorder of the piecewise capture running in this context, if any."""
    rec = active_recorder()
    return rec if isinstance(rec, PieceRecorder) else None


def _tensors(tree: object) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _rerun(tag: str, fn: Callable[..., Any], args: tuple[Any, ...], targets: list[Any]) -> None:
    """Replay of a piece (eager engine) or splitting call: run again, refresh the targets."""
    new = tree_leaves(fn(*args))
    for target, value in zip(targets, new, strict=True):
        if isinstance(target, torch.Tensor):
            refresh(target, value, tag)


def _value_of_leaves(result: Any, n: int, life: Lifetimes | None) -> list[int]:
    """The returned value each of the ``n`` leaves of ``result`` belongs to; -1: unknown (pinned)."""
    if life is not None:
        values = [result] if not life.multi else list(result) if isinstance(result, tuple | list) else None
        if values is not None and len(values) == len(life.pinned):
            groups = [j for j, v in enumerate(values) for _ in tree_leaves(v)]
            if len(groups) == n:
                return groups
    return [-1] * n


@dataclass(frozen=True, slots=True)
class Lifetimes:
    """Liveness around one piece or splitting call, from the split graph: ``multi``: it returns
    a tuple of values (else one); ``pinned`` (per value): read by the graph's output or unknown
    readers, never reused in the key; ``dying`` (per argument): last read by this call."""

    multi: bool
    pinned: tuple[bool, ...]
    dying: tuple[bool, ...]


Reg = tuple[Any, int]  # ((dtype, device), number)


class Registers:
    """One key's bridge slots: slot ``pw.reg{n}`` of a signature is reused once no live value sits
    in it (a count of live values per register; pinned ones are never freed). The lowest free
    number is taken first, so keys running the same calls name the same slots."""

    def __init__(self, store: SlotStore) -> None:
        self.store = store
        self.of: dict[tuple[str, int], Reg] = {}  # slot storage -> register
        self._refs: Counter[Reg] = Counter()
        self._pinned: set[Reg] = set()
        self._free: dict[Any, list[int]] = {}  # signature -> heap of free numbers
        self._made: Counter[Any] = Counter()

    def alloc(self, like: torch.Tensor) -> tuple[Reg, torch.Tensor]:
        sig = (like.dtype, str(like.device))
        free = self._free.setdefault(sig, [])
        n = heapq.heappop(free) if free else self._made[sig]
        self._made[sig] = max(self._made[sig], n + 1)
        slot = self.store.view(f"pw.reg{n}", like)
        self.of[storage_key(slot)] = (sig, n)
        return (sig, n), slot

    def hold(self, regs: set[Reg], pinned: bool) -> None:
        for reg in regs:
            self._refs[reg] += 1
            if pinned:
                self._pinned.add(reg)

    def drop(self, regs: set[Reg]) -> None:
        for reg in regs:
            self._refs[reg] -= 1
            if self._refs[reg] < 0:  # accounting out of step: never reuse it
                self._pinned.add(reg)
            elif self._refs[reg] == 0 and reg not in self._pinned:
                heapq.heappush(self._free[reg[0]], reg[1])


class PieceRecorder(Recorder):
    """Records the pieces and splitting calls of one key (set active while its forward runs)."""

    def __init__(
        self, key: object, segments: Segments, bridges: SlotStore, static_inputs: frozenset[tuple[str, int]] = frozenset()
    ) -> None:
        super().__init__(key, segments)
        self.inputs: set[tuple[str, int]] = set(static_inputs)
        self.slots: set[tuple[str, int]] = set()
        self.regs = Registers(bridges)
        self.graph_calls = 0

    # -- called by the compiled program -------------------------------------------------------
    def note_inputs(self, args: tuple[Any, ...]) -> None:
        self.graph_calls += 1
        self.inputs.update(storage_key(t) for t in _tensors(args))
        self.held.append(args)

    def run_piece(
        self, tag: str, fn: Callable[..., Any], args: tuple[Any, ...], *, bridge: bool, life: Lifetimes | None = None
    ) -> Any:
        if self.in_break:  # a compiled callable inside a splitting op: nothing to record
            return fn(*args)
        result = fn(*args)
        leaves, spec = tree_flatten(result)
        targets = self._bridge(result, leaves, args, life, bridge)
        # The last piece's own outputs cross no boundary: they go to the output policy, which
        # adopts them (held by the static output) or copies them into the shared buffer inside
        # this graph. Holding them here would pin every key's raw output in the pool.
        self._hold(args, targets, keep_targets=bridge)
        self.segments.record(functools.partial(_rerun, tag, fn, args, targets))
        return tree_unflatten(targets, spec)

    def run_split(self, tag: str, fn: Callable[..., Any], args: tuple[Any, ...], *, life: Lifetimes | None = None) -> Any:
        if self.in_break:
            return fn(*args)
        with self.eager_break():
            result = fn(*args)
            leaves, spec = tree_flatten(result)
            targets = self._bridge(result, leaves, args, life, True)  # eager copies, between graphs
        self._hold(args, targets)
        self.steps.append(functools.partial(_rerun, tag, fn, args, targets))
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
        owned = []
        for _, t in leaves:
            sk = storage_key(t)
            # Bridge slots are shared by every key, inputs by the caller: the output owns a copy.
            owned.append(t.clone() if sk in self.slots or sk in self.inputs else t)
        return finalize(unflatten(node, owned))

    # -- helpers ------------------------------------------------------------------------------
    def _bridge(
        self, result: Any, leaves: list[Any], args: tuple[Any, ...], life: Lifetimes | None, bridge: bool
    ) -> list[Any]:
        """Targets of ``leaves``: fresh tensors copied into registers (if ``bridge``), others as is.

        Outputs aliasing a register hold it first, then the arguments read here for the last time
        release theirs, then fresh outputs take free registers (every output is computed by now,
        so taking an argument's register is safe)."""
        regs, pins = self.regs, life.pinned if life is not None else ()
        groups = _value_of_leaves(result, len(leaves), life)
        in_args = {storage_key(t) for t in _tensors(args)}
        self._hold_aliases(leaves, groups, in_args, pins)
        if life is not None and len(life.dying) == len(args):
            for arg in (a for a, dying in zip(args, life.dying, strict=True) if dying):
                regs.drop({regs.of[k] for k in map(storage_key, _tensors(arg)) if k in regs.of})
        targets: list[Any] = []
        for leaf, j in zip(leaves, groups, strict=True):
            if bridge and isinstance(leaf, torch.Tensor) and storage_key(leaf) not in in_args:
                reg, slot = regs.alloc(leaf)
                slot.copy_(leaf)
                regs.hold({reg}, j < 0 or pins[j])
                self.slots.add(storage_key(slot))
                targets.append(slot)
            else:
                targets.append(leaf)  # not a tensor, or aliases an input: already stable
        return targets

    def _hold_aliases(
        self, leaves: list[Any], groups: list[int], in_args: set[tuple[str, int]], pins: tuple[bool, ...]
    ) -> None:
        """Outputs aliasing an argument that sits in a register hold that register."""
        regs = self.regs
        aliased: dict[int, set[Reg]] = {}
        for leaf, j in zip(leaves, groups, strict=True):
            if isinstance(leaf, torch.Tensor) and (k := storage_key(leaf)) in in_args and k in regs.of:
                aliased.setdefault(j, set()).add(regs.of[k])
        for j, rs in aliased.items():
            regs.hold(rs, j < 0 or pins[j])

    def _hold(self, args: tuple[Any, ...], targets: list[Any], *, keep_targets: bool = True) -> None:
        self.held.append((args, targets) if keep_targets else (args,))


class PieceFront:
    """The Piecewise front of the segmented engine: a :class:`PieceRecorder` per key over the
    partition's bridge registers. On CUDA a warmup must run first (it compiles)."""

    min_cuda_warmups = 1

    def __init__(self) -> None:
        self.bridges = PartitionStores()

    def recorder(
        self, key: object, segments: Segments, partition: int | None, static_inputs: frozenset[tuple[str, int]]
    ) -> PieceRecorder:
        return PieceRecorder(key, segments, self.bridges(partition), static_inputs)

    def bridge_bytes(self) -> dict[int | None, int]:
        return self.bridges.nbytes()

    def release(self) -> None:
        self.bridges.clear()
