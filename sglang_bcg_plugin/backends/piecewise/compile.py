"""Piecewise compilation: ``torch.compile`` with our compile backend (split at splitting ops).

``torch.compile(model, backend=PiecewiseCompiler(ops), fullgraph=True)`` hands us one FX graph
per compilation; :func:`~.split.split_graph` cuts it at the splitting ops.

The size dimension of every tensor argument is marked dynamic and dynamo traces with
size-oblivious reasoning, so one compilation serves every capture size (size 1 included: with
plain dynamic shapes dynamo specializes sizes 0 and 1 and would recompile for them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
from torch.utils._pytree import tree_leaves

from .split import SplitProgram, SplitSummary, split_graph


class PiecewiseCompiler:
    """The ``torch.compile`` backend: split, wrap, and report each compilation."""

    def __init__(self, ops: tuple[torch._ops.OpOverload, ...], on_split: Callable[[SplitSummary], None]) -> None:
        self.ops = ops
        self.on_split = on_split

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        split_gm, summary = split_graph(gm, self.ops)
        self.on_split(summary)
        return SplitProgram(split_gm)


DynamicMode = Literal["unbacked", "size_oblivious", "backed"]
_MODES = ("unbacked", "size_oblivious", "backed")


def _size_oblivious() -> contextlib.AbstractContextManager[None]:
    """Trace backed sizes without 0/1 specialization (feature-detected)."""
    config = torch.fx.experimental._config
    if hasattr(config, "backed_size_oblivious"):
        return config.patch(backed_size_oblivious=True)  # type: ignore[no-any-return,attr-defined]
    return contextlib.nullcontext()  # pragma: no cover - older torch: size 1 recompiles once


def _tensors(tree: object) -> Iterator[torch.Tensor]:
    for leaf in tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            yield leaf


class PiecewiseCompiled:
    """``backend.compile(model)``: the model compiled with the piecewise compile backend.

    Every call marks the size dim (``dynamic_dim``: 0 for tokens-first ``[tokens, hidden]``, 1
    for batch-first ``[1, seq]`` such as transformers' ``input_ids``) of each tensor argument
    with more than ``dynamic_dim`` dims (top level, or inside lists, tuples and dicts) dynamic
    before dynamo sees it, as ``dynamic`` says:

    * ``"unbacked"`` (default): ``mark_unbacked``; no size is special, so one compilation serves
      every size, 1 included. A model that branches on the size fails to compile, loudly.
    * ``"size_oblivious"``: ``maybe_mark_dynamic`` traced with ``backed_size_oblivious``; sizes
      0/1 are not specialized unless an op insists (``.contiguous()`` of a split view does, so
      size 1 may recompile once).
    * ``"backed"``: plain ``maybe_mark_dynamic``; dynamo specializes sizes 0 and 1 (one extra
      compilation for size 1).
    """

    def __init__(
        self,
        model: Callable[..., Any],
        compiler: PiecewiseCompiler,
        *,
        dynamic: DynamicMode = "unbacked",
        dynamic_dim: int = 0,
    ) -> None:
        if dynamic not in _MODES:
            msg = f"dynamic must be one of {', '.join(map(repr, _MODES))}, got {dynamic!r}"
            raise ValueError(msg)
        if isinstance(dynamic_dim, bool) or not isinstance(dynamic_dim, int) or dynamic_dim < 0:
            msg = f"dynamic_dim must be an int >= 0 (the dim that varies with the capture size), got {dynamic_dim!r}"
            raise ValueError(msg)
        self.original = model
        self.compiler = compiler
        self.dynamic = dynamic
        self.dynamic_dim = dynamic_dim
        self.compiled = torch.compile(model, backend=compiler, fullgraph=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        dim = self.dynamic_dim
        for t in _tensors((args, kwargs)):
            if t.dim() <= dim:
                continue
            if self.dynamic == "unbacked":
                torch._dynamo.decorators.mark_unbacked(t, dim)
            else:
                torch._dynamo.maybe_mark_dynamic(t, dim)
        with _size_oblivious() if self.dynamic == "size_oblivious" else contextlib.nullcontext():
            return self.compiled(*args, **kwargs)
