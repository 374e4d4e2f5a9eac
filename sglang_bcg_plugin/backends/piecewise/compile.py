"""Piecewise compilation: ``torch.compile`` with our compile backend (split at splitting ops).

``torch.compile(model, backend=PiecewiseCompiler(ops), fullgraph=True)`` hands us one FX graph
per compilation; :func:`~.split.split_graph` cuts it at the splitting ops and, with
``inductor=True``, compiles every piece with Inductor (:mod:`.inductor`).

The size dimension of every tensor argument is marked dynamic (unbacked, or backed and traced
with size-oblivious reasoning when Inductor compiles the pieces), so one compilation serves every
capture size (size 1 included: with plain dynamic shapes dynamo specializes sizes 0 and 1 and
would recompile for them).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch.utils._pytree import tree_map_only

from ...engines.recorder import untracked
from .inductor import InductorPieces
from .split import SplitProgram, SplitSummary, split_graph


class PiecewiseCompiler:
    """The ``torch.compile`` backend: split (compile the pieces), wrap, report each compilation.

    :param inductor: compiles every piece with Inductor; ``None``: pieces run as traced.
    """

    def __init__(
        self,
        ops: tuple[torch._ops.OpOverload, ...],
        on_split: Callable[[SplitSummary], None],
        inductor: InductorPieces | None = None,
    ) -> None:
        self.ops = ops
        self.on_split = on_split
        self.inductor = inductor
        self.calls = 0
        self.compile_seconds = 0.0  # wall time of the calls that compiled (PiecewiseCompiled)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        self.calls += 1
        split_gm, summary = split_graph(gm, self.ops, self.inductor, example_inputs)
        self.on_split(summary)
        return SplitProgram(split_gm)


DynamicMode = Literal["auto", "unbacked", "size_oblivious", "backed"]
_MODES = ("auto", "unbacked", "size_oblivious", "backed")


def resolve_dynamic(dynamic: DynamicMode, inductor: bool) -> DynamicMode:
    """``"auto"`` made concrete: ``"size_oblivious"`` when Inductor compiles the pieces,
    ``"unbacked"`` otherwise; any other mode as given.

    Inductor picks kernels by size hints. An unbacked size has none (Inductor assumes a fallback
    size), and its symbolic sizes block fusions: on the bench's Llama at 16384 tokens the pieces
    launched 27 distinct kernels (3.15 ms of Triton per replay) unbacked against 16 (1.48 ms)
    backed and size-oblivious (``docs/piecewise.md``). Pieces run as traced take no hint, and
    unbacked compiles once for every size.
    """
    if dynamic == "auto":
        return "size_oblivious" if inductor else "unbacked"
    return dynamic


def _size_oblivious() -> contextlib.AbstractContextManager[None]:
    """Trace backed sizes without 0/1 specialization (feature-detected)."""
    config = torch.fx.experimental._config
    if hasattr(config, "backed_size_oblivious"):
        return config.patch(backed_size_oblivious=True)  # type: ignore[no-any-return,attr-defined]
    return contextlib.nullcontext()  # pragma: no cover - older torch: size 1 recompiles once


def _canonical(t: torch.Tensor) -> torch.Tensor:
    """``t``, or for a contiguous ``t`` whose size-1 dims have odd strides, a view with the
    standard ones (same storage and elements).

    A size-1 dim's stride never addresses anything, yet dynamo guards on it: ``ids[:, :s]`` of
    a ``[1, max]`` buffer has stride ``(max, 1)``, contiguous only at ``s == max``, so every
    smaller size failed ``stride()[0] == size()[1]`` and recompiled once.
    """
    if not t.is_contiguous():
        return t
    want = []
    step = 1
    for size in reversed(t.shape):
        want.append(step)
        step *= max(size, 1)
    want.reverse()
    return t if list(t.stride()) == want else t.as_strided(t.shape, want)


class PiecewiseCompiled:
    """``backend.compile(model)``: the model compiled with the piecewise compile backend.

    Every call marks the size dim (``dynamic_dim``: 0 for tokens-first ``[tokens, hidden]``, 1
    for batch-first ``[1, seq]`` such as transformers' ``input_ids``) of each tensor argument
    with more than ``dynamic_dim`` dims (top level, or inside lists, tuples and dicts) dynamic
    before dynamo sees it, as ``dynamic`` says:

    * ``"auto"`` (default): ``"size_oblivious"`` with Inductor pieces (its kernels are chosen by
      a real size hint), ``"unbacked"`` otherwise (:func:`resolve_dynamic`).
    * ``"unbacked"``: ``mark_unbacked``; no size is special, so one compilation serves every
      size, 1 included. A model that branches on the size fails to compile, loudly.
    * ``"size_oblivious"``: ``maybe_mark_dynamic`` traced with ``backed_size_oblivious``; sizes
      0/1 are not specialized unless an op insists (``.contiguous()`` of a split view does, so
      size 1 may recompile once). The first size compiled is the hint Inductor tunes for.
    * ``"backed"``: plain ``maybe_mark_dynamic``; dynamo specializes sizes 0 and 1 (one extra
      compilation for size 1).

    The compiler's ``compile_seconds`` sums the wall time of the calls that compiled (dynamo, the
    split, Inductor if on, and the first run, where Inductor's kernels load and autotune): the
    warmups pay it, never a capture.
    """

    def __init__(
        self,
        model: Callable[..., Any],
        compiler: PiecewiseCompiler,
        *,
        dynamic: DynamicMode = "auto",
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
        self.dynamic = resolve_dynamic(dynamic, compiler.inductor is not None)
        self.dynamic_dim = dynamic_dim
        self.compiled = torch.compile(model, backend=compiler, fullgraph=True)

    def _mark(self, t: torch.Tensor) -> torch.Tensor:
        dim = self.dynamic_dim
        if t.dim() <= dim:
            return t
        t = _canonical(t)
        if self.dynamic == "unbacked":
            torch._dynamo.decorators.mark_unbacked(t, dim)
        else:
            torch._dynamo.maybe_mark_dynamic(t, dim)
        return t

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = tree_map_only(torch.Tensor, self._mark, (args, kwargs))
        calls, start = self.compiler.calls, time.perf_counter()
        # On the eager engine the pieces record their own replay: the open segment's op tape
        # pauses for the compiled call (and dynamo sees no dispatch mode).
        with untracked(), _size_oblivious() if self.dynamic == "size_oblivious" else contextlib.nullcontext():
            out = self.compiled(*args, **kwargs)
        if self.compiler.calls != calls:  # this call compiled: charge it, kernels finished
            if torch.cuda.is_initialized():  # pragma: no cover - CUDA only
                torch.cuda.synchronize()
            self.compiler.compile_seconds += time.perf_counter() - start
        return out
