"""Piecewise compilation: ``torch.compile`` with our compile backend (split at splitting ops).

``torch.compile(model, backend=PiecewiseCompiler(ops), fullgraph=True)`` hands us one FX graph
per compilation; :func:`~.split.split_graph` cuts it at the splitting ops and, with
``inductor=True``, compiles every piece with Inductor (:mod:`.inductor`).

The size dimension of every tensor argument that varies with the capture size is marked dynamic
(unbacked, or backed and traced with size-oblivious reasoning when Inductor compiles the pieces),
so one compilation serves every capture size (size 1 included: with plain dynamic shapes dynamo
specializes sizes 0 and 1 and would recompile for them). A tensor whose size dim does not follow
the capture size (a ``[1]`` scale, a fixed table, a 0-dim tensor) stays static
(:class:`SizeDims`): marked dynamic, dynamo would reason about a symbol where the model relies on
a fixed extent (``x * scale`` broadcasting) and fail its own guards.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from ...engines.recorder import untracked
from .inductor import InductorPieces
from .split import SplitProgram, SplitSummary, split_graph


class PiecewiseCompileError(RuntimeError):
    """Dynamo could not trace the model as one graph (``fullgraph=True``); dynamo's own report
    is the cause (``__cause__``) and is quoted in the message."""


def _untraceable(exc: Exception) -> PiecewiseCompileError:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    msg = (
        f"backend.compile(model): torch.compile must trace the model as one graph (fullgraph=True: "
        f"work outside it would be missing from the pieces' replay) and could not ({first}). Make "
        f"code that must run eagerly between the pieces a torch.library custom op and list it in "
        f"splitting_ops; a @graph_break function is traced through under Piecewise, it is no "
        f"split point (docs/piecewise.md). Dynamo's report:\n{exc}"
    )
    return PiecewiseCompileError(msg)


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
    size), and its symbolic sizes block fusions, so Inductor's pieces get fewer, faster kernels
    size-oblivious (the measured difference: ``docs/piecewise.md``). Pieces run as traced take no
    hint, and unbacked compiles once for every size.
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


_capture_size: contextvars.ContextVar[int | None] = contextvars.ContextVar("sglang_bcg_capture_size", default=None)


@contextlib.contextmanager
def capture_size(size: object) -> Iterator[None]:
    """Calls of compiled callables in the body run for a key of this capture size (an int;
    anything else: unknown). ``PiecewiseBackend.capture_one`` sets it around warmups and capture."""
    known = size if isinstance(size, int) and not isinstance(size, bool) else None
    token = _capture_size.set(known)
    try:
        yield
    finally:
        _capture_size.reset(token)


class SizeDims:
    """Which tensor arguments of a compiled callable have a size dim that follows the capture size.

    At each call, of the tensors with more than ``dim`` dims, those whose extent at ``dim``
    is the call's *reference* are candidates: the capture size when the call runs inside
    ``capture_one`` and some tensor has it there, else the largest extent at ``dim`` (a direct
    call; or rows that are a multiple of the size, as in speculative decoding). A tensor is
    marked dynamic while *every* call so far (of this argument structure) found it a candidate:
    one whose extent differed once (a ``[1]`` scale, a fixed table) is static for good. So marks
    only ever shrink after the first call, and dynamo, which recompiles when a call marks a dim
    its graph compiled static, never recompiles for them. A reference of 1 tells nothing (every
    broadcast dim has extent 1): such a call marks what the calls before it marked, nothing if
    it is the first.
    """

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self._marks: dict[tuple[TreeSpec, tuple[int | None, ...]], frozenset[int]] = {}

    def marked(self, leaves: list[Any], spec: TreeSpec) -> frozenset[int]:
        """Indices of ``leaves`` (of a call flattened to ``spec``) to mark dynamic at ``dim``."""
        extents = [t.shape[self.dim] if isinstance(t, torch.Tensor) and t.dim() > self.dim else None for t in leaves]
        sizes = {e for e in extents if e is not None}
        if not sizes:
            return frozenset()
        key = (spec, tuple(t.dim() if isinstance(t, torch.Tensor) else None for t in leaves))
        size = _capture_size.get()
        reference = size if size in sizes else max(sizes)
        before = self._marks.get(key)
        if reference == 1:
            return before or frozenset()
        now = frozenset(i for i, e in enumerate(extents) if e == reference)
        marks = now if before is None else before & now
        self._marks[key] = marks
        return marks


class PiecewiseCompiled:
    """``backend.compile(model)``: the model compiled with the piecewise compile backend.

    Every call marks the size dim (``dynamic_dim``: 0 for tokens-first ``[tokens, hidden]``, 1
    for batch-first ``[1, seq]`` such as transformers' ``input_ids``) of each tensor argument
    (top level, or inside lists, tuples and dicts) whose extent there follows the capture size
    (:class:`SizeDims`; other tensors, 0-dim ones and non-tensors stay static) dynamic before
    dynamo sees it, as ``dynamic`` says:

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
        self.size_dims = SizeDims(dynamic_dim)
        self.compiled = torch.compile(model, backend=compiler, fullgraph=True)

    def _mark(self, t: torch.Tensor) -> torch.Tensor:
        t = _canonical(t)
        if self.dynamic == "unbacked":
            torch._dynamo.decorators.mark_unbacked(t, self.dynamic_dim)
        else:
            torch._dynamo.maybe_mark_dynamic(t, self.dynamic_dim)
        return t

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, spec = tree_flatten((args, kwargs))
        marks = self.size_dims.marked(leaves, spec)
        if marks:
            leaves = [self._mark(t) if i in marks else t for i, t in enumerate(leaves)]
            args, kwargs = tree_unflatten(leaves, spec)
        calls, start = self.compiler.calls, time.perf_counter()
        # On the eager engine the pieces record their own replay: the open segment's op tape
        # pauses for the compiled call (and dynamo sees no dispatch mode).
        with untracked(), _size_oblivious() if self.dynamic == "size_oblivious" else contextlib.nullcontext():
            try:
                out = self.compiled(*args, **kwargs)
            except torch._dynamo.exc.Unsupported as exc:
                raise _untraceable(exc) from exc
        if self.compiler.calls != calls:  # this call compiled: charge it, kernels finished
            if torch.cuda.is_initialized():  # pragma: no cover - CUDA only
                torch.cuda.synchronize()
            self.compiler.compile_seconds += time.perf_counter() - start
        return out
