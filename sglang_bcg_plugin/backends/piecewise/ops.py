"""Splitting ops: validate what users pass, resolve op packets to their overloads, and say which of
torch's own ops a traced graph never calls."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch._library.custom_ops import CustomOpDef

from ...errors import SplittingOpError

#: Namespaces of torch's own ops. Dynamo's graph holds the torch functions a model calls
#: (``torch.mm``, ``x @ w``, ``Tensor.softmax``), not the ops of these namespaces they dispatch to.
TORCH_NAMESPACES = frozenset({"aten", "prims", "prim"})

#: The forms ``splitting_ops`` accepts, said by every error about them.
ACCEPTED = ("a torch.library custom op: the object torch.library.custom_op returns, an OpOverload "
            "(torch.ops.ns.op.default) or an OpOverloadPacket (torch.ops.ns.op)")


def resolve_splitting_ops(ops: Iterable[object] | None) -> tuple[torch._ops.OpOverload, ...]:
    """``splitting_ops`` (``OpOverload``, ``OpOverloadPacket``, ``custom_op`` objects), packets resolved
    to all their overloads. :raises SplittingOpError: not a list of ops, or an empty packet."""
    if ops is None:
        return ()
    single = (str, bytes, torch._ops.OpOverload, torch._ops.OpOverloadPacket)
    if isinstance(ops, single) or not isinstance(ops, Iterable):
        msg = (f"splitting_ops must be a list of torch op overloads, got {ops!r} "
               f"({type(ops).__name__}); wrap a single op in a list: splitting_ops=[torch.ops.ns.op.default]")
        raise SplittingOpError(msg)
    resolved: dict[torch._ops.OpOverload, None] = {}
    for i, op in enumerate(ops):
        if isinstance(op, CustomOpDef):  # what torch.library.custom_op returns
            op = op._opoverload
        if isinstance(op, torch._ops.OpOverload):
            resolved[op] = None
        elif isinstance(op, torch._ops.OpOverloadPacket):
            names = op.overloads()
            if not names:
                msg = f"splitting_ops[{i}] = {op!r} is an op packet without overloads; nothing could split there"
                raise SplittingOpError(msg)
            for name in names:
                resolved[getattr(op, name)] = None
        else:
            msg = f"splitting_ops[{i}] = {op!r} ({type(op).__name__}) is not a torch op: expected {ACCEPTED}"
            if isinstance(op, str):
                ns, _, name = op.partition("::")
                msg += f" (strings are not resolved: pass torch.ops.{ns}.{name or '<op>'}.default)"
            raise SplittingOpError(msg)
    return tuple(resolved)


def unsplit_torch_ops(ops: tuple[torch._ops.OpOverload, ...], gm: torch.fx.GraphModule) -> list[str]:
    """Torch's own ops (:data:`TORCH_NAMESPACES`) among ``ops`` whose packet no call of ``gm`` reaches:
    splitting there was asked for and cannot happen."""
    called = {node.target.overloadpacket if isinstance(node.target, torch._ops.OpOverload) else node.target
              for node in gm.graph.nodes if node.op == "call_function"}
    return sorted({str(op.overloadpacket) for op in ops
                   if op.namespace in TORCH_NAMESPACES and op.overloadpacket not in called})


def unsplit_message(names: list[str]) -> str:
    """The :class:`PiecewiseCompileError` text for torch's own ops the graph never calls."""
    return (f"backend.compile(model): splitting_ops lists torch's own op(s) {', '.join(names)}, which the graph "
            "torch.compile traced never calls: dynamo records the torch functions the model calls (torch.mm, x @ w, "
            "torch.softmax, Tensor.softmax), not the aten ops they dispatch to, so nothing would split there and the "
            "model would be one piece. An aten op splits only where the model calls torch.ops.aten.<op> itself. To "
            "run that work eagerly between pieces, put it in a torch.library custom op and list that: splitting_ops "
            f"takes {ACCEPTED} (docs/piecewise.md, 'Splitting ops')")
