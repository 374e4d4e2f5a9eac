"""Split a dynamo FX graph at splitting ops; pieces and splitting calls become runners.

We cut the graph before and after every call of a splitting op (keeping the original node order,
which matters when ops mutate their arguments), so a graph with ``k`` splitting calls becomes
``piece, op, piece, op, ..., piece``. Each piece becomes a :class:`PieceRunner` and each
splitting call a :class:`SplitRunner`; outside a capture both just run their sub-graph. While a
key is captured, both hand their work to the active recorder (:mod:`.record`), which captures
pieces as CUDA graphs (or records them on the eager engine) and runs splitting ops eagerly
between them; values cross them as they are (zero-copy). With an
:class:`~.inductor.InductorPieces`, every piece runs as its Inductor-compiled callable instead
of the traced FX graph (:mod:`.inductor`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx.passes.split_module import split_module

from .inductor import InductorPieces, dense_fresh
from .record import active_piece_recorder

_graph_ids = itertools.count()


@dataclass(frozen=True, slots=True)
class SplitSummary:
    """What one compilation was split into.

    :param graph_id: process-unique id of the compiled FX graph.
    :param num_pieces: non-empty pieces (CUDA-graph candidates); ``k + 1`` for ``k`` splitting
        calls with work on both sides of each.
    :param num_splitting_calls: calls of splitting ops in the graph (each runs eagerly).
    :param splitting_targets: the op of each splitting call, in graph order.
    """

    graph_id: int
    num_pieces: int
    num_splitting_calls: int
    splitting_targets: tuple[str, ...]


class PieceRunner(torch.nn.Module):
    """A piece: plain call outside a capture, recorded/captured inside one.

    :param compiled: the piece compiled by Inductor; runs instead of the FX ``piece``. Its
        outputs keep the layout Inductor gives them (the eager strides): they cross a splitting
        call as they are, so the next piece meets the same layout inside a capture and outside.
    """

    def __init__(self, piece: torch.fx.GraphModule, tag: str, compiled: Callable[..., Any] | None = None) -> None:
        super().__init__()
        self.piece = piece
        self.tag = tag
        self.compiled = compiled

    def _run(self, *args: Any) -> Any:
        fn = self.piece if self.compiled is None else self.compiled
        return fn(*args)

    def forward(self, *args: Any) -> Any:
        recorder = active_piece_recorder()
        if recorder is None:
            return self._run(*args)
        return recorder.run_piece(self.tag, self._run, args)


class SplitRunner(torch.nn.Module):
    """A splitting call: always eager; inside a capture it ends a piece and starts the next.

    :param dense: make fresh outputs dense (the pieces are compiled).
    """

    def __init__(self, call: torch.fx.GraphModule, tag: str, dense: bool = False) -> None:
        super().__init__()
        self.call = call
        self.tag = tag
        self.dense = dense

    def _run(self, *args: Any) -> Any:
        return dense_fresh(self.call(*args), args) if self.dense else self.call(*args)

    def forward(self, *args: Any) -> Any:
        recorder = active_piece_recorder()
        if recorder is None:
            return self._run(*args)
        return recorder.run_split(self.tag, self._run, args)


class SplitProgram:
    """What the compile backend returns to dynamo: the split module, noting its inputs."""

    def __init__(self, module: torch.fx.GraphModule) -> None:
        self.module = module

    def __call__(self, *args: Any) -> Any:
        recorder = active_piece_recorder()
        if recorder is not None:
            recorder.note_inputs(args)
        return self.module(*args)


def _matcher(ops: tuple[torch._ops.OpOverload, ...]) -> Callable[[torch.fx.Node], bool]:
    overloads = frozenset(ops)
    packets = frozenset(op.overloadpacket for op in ops)

    def is_split(node: torch.fx.Node) -> bool:
        if node.op != "call_function":
            return False
        target = node.target
        # dynamo records `torch.ops.ns.op(...)` as the packet: it splits if any overload does.
        return target in overloads or (isinstance(target, torch._ops.OpOverloadPacket) and target in packets)

    return is_split


def _partition(
    gm: torch.fx.GraphModule, is_split: Callable[[torch.fx.Node], bool]
) -> tuple[dict[torch.fx.Node, int], set[int], list[str]]:
    """Each node's partition (a new one before and after every splitting call), the partitions
    that are splitting calls, and the calls' targets."""
    part: dict[torch.fx.Node, int] = {}
    split_ids: set[int] = set()
    targets: list[str] = []
    pid = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_split(node):
            pid += 1
            part[node] = pid
            split_ids.add(pid)
            targets.append(str(node.target))
            pid += 1
        else:
            part[node] = pid
    return part, split_ids, targets


def split_graph(
    gm: torch.fx.GraphModule,
    ops: tuple[torch._ops.OpOverload, ...],
    inductor: InductorPieces | None = None,
    example_inputs: list[Any] | None = None,
) -> tuple[torch.fx.GraphModule, SplitSummary]:
    """Split ``gm`` at every call of ``ops``; pieces and calls become runner sub-modules.

    With ``inductor``, every piece is compiled for dynamo's ``example_inputs`` first.
    """
    graph_id = next(_graph_ids)
    part, split_ids, targets = _partition(gm, _matcher(ops))
    # keep_original_order: splitting ops may mutate their arguments, so nodes must not move.
    split_gm = split_module(gm, None, lambda n: part[n], keep_original_order=True)  # type: ignore[arg-type]
    order = [n.target for n in split_gm.graph.nodes if n.op == "call_module"]
    names = [str(n) for n in order]
    is_call = {name: int(name.rsplit("_", 1)[1]) in split_ids for name in names}
    pieces = [name for name in names if not is_call[name]]
    compiled = {}
    if inductor is not None:
        calls = [name for name in names if is_call[name]]
        compiled = inductor.compile(split_gm, example_inputs or [], pieces, calls)
    for name in names:
        sub = getattr(split_gm, name)
        tag = f"g{graph_id}.{name}"
        if is_call[name]:
            split_gm.add_module(name, SplitRunner(sub, tag, dense=inductor is not None))
        else:
            split_gm.add_module(name, PieceRunner(sub, tag, compiled.get(name)))
    num_pieces = len(pieces)
    summary = SplitSummary(graph_id, num_pieces, len(targets), tuple(targets))
    return split_gm, summary
