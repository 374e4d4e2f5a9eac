"""Split a dynamo FX graph at splitting ops; pieces and splitting calls become runners.

We cut the graph before and after every call of a splitting op (keeping the original node order,
which matters when ops mutate their arguments), so a graph with ``k`` splitting calls becomes
``piece, op, piece, op, ..., piece``. Each piece becomes a :class:`PieceRunner` and each
splitting call a :class:`SplitRunner`; outside a capture both just run their sub-graph. While a
key is captured, both hand their work to the active recorder (:mod:`.record`), which captures
pieces as CUDA graphs (or records them on the eager engine) and runs splitting ops eagerly
between them. :func:`_lifetimes` tells the recorder which bridged values die where. With an
:class:`~.inductor.InductorPieces`, every piece runs as its Inductor-compiled callable instead
of the traced FX graph (:mod:`.inductor`).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx.passes.split_module import split_module

from .inductor import InductorPieces, dense_fresh
from .record import Lifetimes, active_piece_recorder

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

    :param compiled: the piece compiled by Inductor; runs instead of the FX ``piece``, and a
        bridged piece's fresh outputs are made dense outside a capture as the bridge makes them
        inside one (the next compiled piece checks their strides).
    """

    def __init__(
        self,
        piece: torch.fx.GraphModule,
        tag: str,
        bridge: bool,
        life: Lifetimes | None = None,
        compiled: Callable[..., Any] | None = None,
    ) -> None:
        super().__init__()
        self.piece = piece
        self.tag = tag
        self.bridge = bridge  # a splitting op follows: outputs go through the bridge arena
        self.life = life  # which outputs outlive the graph's calls, which arguments die here
        self.compiled = compiled
        self.dense = compiled is not None and bridge

    def forward(self, *args: Any) -> Any:
        fn = self.piece if self.compiled is None else self.compiled
        recorder = active_piece_recorder()
        if recorder is None:
            return dense_fresh(fn(*args), args) if self.dense else fn(*args)
        return recorder.run_piece(self.tag, fn, args, bridge=self.bridge, life=self.life)


class SplitRunner(torch.nn.Module):
    """A splitting call: always eager; inside a capture it ends a piece and starts the next.

    :param dense: make fresh outputs dense outside a capture (the pieces are compiled).
    """

    def __init__(self, call: torch.fx.GraphModule, tag: str, life: Lifetimes | None = None, dense: bool = False) -> None:
        super().__init__()
        self.call = call
        self.tag = tag
        self.life = life
        self.dense = dense

    def forward(self, *args: Any) -> Any:
        recorder = active_piece_recorder()
        if recorder is None:
            return dense_fresh(self.call(*args), args) if self.dense else self.call(*args)
        return recorder.run_split(self.tag, self.call, args, life=self.life)


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


def _returned_values(split_gm: torch.fx.GraphModule, n: torch.fx.Node) -> tuple[bool, list[torch.fx.Node | None]]:
    """Whether call ``n`` returns a tuple, and the node reading each value it returns (``None``:
    unknown, e.g. the tuple is read whole, so every value escapes)."""
    out = next((o for o in getattr(split_gm, str(n.target)).graph.nodes if o.op == "output"), None)
    multi = out is not None and isinstance(out.args[0], (tuple, list))
    if not multi:
        return False, [n] if out is not None else []
    values: list[torch.fx.Node | None] = [None] * len(out.args[0])  # type: ignore[union-attr, arg-type]
    for u in n.users:
        i = u.args[1] if u.target is operator.getitem and len(u.args) == 2 else None
        if not (isinstance(i, int) and 0 <= i < len(values)):
            return True, [None] * len(values)  # read whole: every value escapes
        values[i] = u
    return True, values


def _lifetimes(split_gm: torch.fx.GraphModule) -> dict[str, Lifetimes]:
    """Per call of ``split_gm``: which values it returns are pinned, which arguments it reads last.

    A returned value is pinned (its bridge slot never reused within the key) when something other
    than a later call reads it (the graph's output) or nobody does: unknown readers, no sharing.
    """
    calls = [n for n in split_gm.graph.nodes if n.op == "call_module"]
    pos = {n: i for i, n in enumerate(calls)}
    last: dict[torch.fx.Node, int | None] = {}  # value -> position of its last reader; None: pinned
    shapes: dict[str, tuple[bool, list[torch.fx.Node | None]]] = {}
    for n in calls:
        multi, values = _returned_values(split_gm, n)
        for v in values:
            if v is not None:
                readers = list(v.users)
                ok = readers and all(u.op == "call_module" for u in readers)
                last[v] = max(pos[u] for u in readers) if ok else None
        shapes[str(n.target)] = (multi, values)
    lives = {}
    for n in calls:
        multi, values = shapes[str(n.target)]
        pinned = tuple(v is None or last[v] is None for v in values)
        dying = tuple(isinstance(a, torch.fx.Node) and last.get(a) == pos[n] for a in n.args)
        lives[str(n.target)] = Lifetimes(multi, pinned, dying)
    return lives


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
    is_split = _matcher(ops)
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
    # keep_original_order: splitting ops may mutate their arguments, so nodes must not move.
    split_gm = split_module(gm, None, lambda n: part[n], keep_original_order=True)  # type: ignore[arg-type]
    order = [n.target for n in split_gm.graph.nodes if n.op == "call_module"]
    lives = _lifetimes(split_gm)
    names = [str(n) for n in order]
    is_call = {name: int(name.rsplit("_", 1)[1]) in split_ids for name in names}
    # A piece is bridged when a splitting call follows it: its fresh outputs go to bridge slots.
    bridged = {name for pos, name in enumerate(names) if any(is_call[later] for later in names[pos + 1 :])}
    pieces = [name for name in names if not is_call[name]]
    compiled = {}
    if inductor is not None:
        dense = [name for name in names if is_call[name] or name in bridged]
        compiled = inductor.compile(split_gm, example_inputs or [], pieces, dense)
    for name in names:
        sub = getattr(split_gm, name)
        tag = f"g{graph_id}.{name}"
        if is_call[name]:
            split_gm.add_module(name, SplitRunner(sub, tag, lives[name], dense=inductor is not None))
        else:
            runner = PieceRunner(sub, tag, name in bridged, lives[name], compiled.get(name))
            split_gm.add_module(name, runner)
    num_pieces = len(pieces)
    summary = SplitSummary(graph_id, num_pieces, len(targets), tuple(targets))
    return split_gm, summary
