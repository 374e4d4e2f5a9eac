"""Split a dynamo FX graph at splitting ops, in node order: ``piece, op, piece, ..., piece``;
pieces become :class:`PieceRunner` and splitting calls :class:`SplitRunner`, which hand their
work to the active piece recorder while a key is captured."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx.passes.split_module import split_module

from .inductor import CompiledPiece, InductorPieces, dense_fresh
from .front import active_piece_recorder

_graph_ids = itertools.count()


@dataclass(frozen=True, slots=True)
class SplitSummary:
    """What one compilation was split into: non-empty pieces, splitting calls and their ops."""

    graph_id: int
    num_pieces: int
    num_splitting_calls: int
    splitting_targets: tuple[str, ...]


class PieceRunner(torch.nn.Module):
    """A piece: a plain call outside a capture, recorded inside one; ``compiled`` (Inductor's) runs
    instead of the FX ``piece``."""

    def __init__(self, piece: torch.fx.GraphModule, tag: str, compiled: CompiledPiece | None = None) -> None:
        super().__init__()
        self.piece, self.tag, self.compiled = piece, tag, compiled

    def _run(self, args: list[Any]) -> Any:
        if self.compiled is not None:
            return self.compiled.boxed(args)
        out = self.piece(*args)
        args.clear()
        return out

    def boxed(self, args: list[Any]) -> Any:
        """Run on ``args``, a list this call empties."""
        recorder = active_piece_recorder()
        return self._run(args) if recorder is None else recorder.run_piece(self.tag, self._run, args)

    def forward(self, *args: Any) -> Any:
        return self.boxed(list(args))


class SplitRunner(torch.nn.Module):
    """A splitting call: always eager; ``dense``: fresh outputs made dense (compiled pieces)."""

    def __init__(self, call: torch.fx.GraphModule, tag: str, dense: bool = False) -> None:
        super().__init__()
        self.call, self.tag, self.dense = call, tag, dense

    def _run(self, *args: Any) -> Any:
        return dense_fresh(self.call(*args), args) if self.dense else self.call(*args)

    def forward(self, *args: Any) -> Any:
        recorder = active_piece_recorder()
        return self._run(*args) if recorder is None else recorder.run_split(self.tag, self._run, args)


class SplitProgram:
    """What the compile backend returns to dynamo: the split module, run so that the program drops
    each value as soon as its last user starts (pieces get their arguments boxed)."""

    def __init__(self, module: torch.fx.GraphModule) -> None:
        self.module = module
        *self._nodes, self._output = module.graph.nodes  # FX keeps the output node last
        last_user = {used: node for node in module.graph.nodes for used in node.all_input_nodes}
        self._dies: dict[torch.fx.Node, list[torch.fx.Node]] = {}
        for used, user in last_user.items():
            self._dies.setdefault(user, []).append(used)

    def __call__(self, *args: Any) -> Any:
        recorder = active_piece_recorder()
        if recorder is not None:
            recorder.note_inputs(args)
        env: dict[torch.fx.Node, Any] = {}
        inputs = iter(args)
        del args
        for node in self._nodes:
            if node.op == "placeholder":
                env[node] = next(inputs)
            else:
                value = self._run_node(node, env)
                if node.users:  # a value nothing reads is dropped at once
                    env[node] = value
                del value
            for used in self._dies.get(node, ()):
                env.pop(used, None)
        return torch.fx.node.map_arg(self._output.args[0], env.__getitem__)

    def _run_node(self, node: torch.fx.Node, env: dict[torch.fx.Node, Any]) -> Any:
        """One node of the split module (``split_module`` makes only these kinds)."""
        if node.op == "get_attr":
            return functools.reduce(getattr, str(node.target).split("."), self.module)
        if node.op == "call_module":
            runner = self.module.get_submodule(str(node.target))
            if isinstance(runner, PieceRunner) and not node.kwargs:
                boxed = [env[a] if isinstance(a, torch.fx.Node) else a for a in node.args]
                for used in self._dies.get(node, ()):
                    del env[used]  # the list holds the only program reference now
                return runner.boxed(boxed)
            fn: Callable[..., Any] = runner
        else:  # call_function (split_module emits no call_method): getitem of a piece's tuple
            fn = node.target  # type: ignore[assignment]
        call_args, call_kwargs = torch.fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
        return fn(*call_args, **call_kwargs)


def _partition(gm: torch.fx.GraphModule,
               ops: tuple[torch._ops.OpOverload, ...]) -> tuple[dict[torch.fx.Node, int], list[str]]:
    """Each node's partition (odd: a call of ``ops``, in a partition of its own; even: a piece) and the
    calls' targets."""
    # dynamo records `torch.ops.ns.op(...)` as the packet: it splits if any overload does.
    splitting = {*ops, *(op.overloadpacket for op in ops)}
    part: dict[torch.fx.Node, int] = {}
    targets: list[str] = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in splitting:
            targets.append(str(node.target))
            part[node] = 2 * len(targets) - 1
        elif node.op not in ("placeholder", "output"):
            part[node] = 2 * len(targets)
    return part, targets


def split_graph(gm: torch.fx.GraphModule, ops: tuple[torch._ops.OpOverload, ...],
                inductor: InductorPieces | None = None,
                example_inputs: list[Any] | None = None) -> tuple[torch.fx.GraphModule, SplitSummary]:
    """Split ``gm`` at every call of ``ops`` into runner sub-modules; with ``inductor``, every piece
    is compiled for dynamo's ``example_inputs`` first."""
    graph_id = next(_graph_ids)
    part, targets = _partition(gm, ops)
    # keep_original_order: splitting ops may mutate their arguments, so nodes must not move.
    split_gm = split_module(gm, None, lambda n: part[n], keep_original_order=True)  # type: ignore[arg-type]
    names = [str(n.target) for n in split_gm.graph.nodes if n.op == "call_module"]
    is_call = {name: int(name.rsplit("_", 1)[1]) % 2 == 1 for name in names}
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
    return split_gm, SplitSummary(graph_id, len(pieces), len(targets), tuple(targets))
