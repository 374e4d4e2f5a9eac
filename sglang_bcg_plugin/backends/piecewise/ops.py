"""Splitting ops: validate what users pass and resolve op packets to their overloads."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch._library.custom_ops import CustomOpDef


def resolve_splitting_ops(ops: Iterable[object] | None) -> tuple[torch._ops.OpOverload, ...]:
    """``splitting_ops`` (``OpOverload``, ``OpOverloadPacket``, ``custom_op`` objects), packets resolved
    to all their overloads. :raises TypeError: not a list of ops. :raises ValueError: an empty packet."""
    if ops is None:
        return ()
    single = (str, bytes, torch._ops.OpOverload, torch._ops.OpOverloadPacket)
    if isinstance(ops, single) or not isinstance(ops, Iterable):
        msg = (f"splitting_ops must be a list of torch op overloads, got {ops!r} "
               f"({type(ops).__name__}); wrap a single op in a list: splitting_ops=[torch.ops.ns.op.default]")
        raise TypeError(msg)
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
                raise ValueError(msg)
            for name in names:
                resolved[getattr(op, name)] = None
        else:
            hint = " (strings are not resolved: pass torch.ops.<ns>.<op>.default)" if isinstance(op, str) else ""
            msg = (f"splitting_ops[{i}] = {op!r} ({type(op).__name__}) is not a torch op: expected a "
                   "torch._ops.OpOverload (torch.ops.ns.op.default), an OpOverloadPacket (torch.ops.ns.op) "
                   f"or a torch.library.custom_op{hint}")
            raise TypeError(msg)
    return tuple(resolved)
