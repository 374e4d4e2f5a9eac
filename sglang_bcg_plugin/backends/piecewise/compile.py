"""Piecewise compilation: ``torch.compile`` with our compile backend, split at splitting ops; the size
dim of the tensors that follow the capture size marked dynamic (docs/piecewise.md#dynamic-shapes)."""

from __future__ import annotations

import contextlib
import contextvars
import re
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal, get_args

import torch
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from ...engines.recorder import untracked
from .inductor import InductorPieces
from .ops import unsplit_message, unsplit_torch_ops
from .split import SplitProgram, SplitSummary, split_graph


class PiecewiseCompileError(RuntimeError):
    """Dynamo could not trace the model as one graph, or with its size dynamic (a call broke what it assumed of the
    size), or ``splitting_ops`` names torch's own op the graph never calls; dynamo's report is the cause."""


#: What torch raises when a call breaks an assumption about the size made while tracing: an assert
#: compiled into the graph, a guard dynamo made and failed at once.
_SHAPE_ASSUMPTIONS = ("Runtime assertion failed for expression", "Guard failed on the same frame it was created")

#: What dynamo raises for a model it cannot run on fake tensors (the model's error, or a symbolic
#: size's): the ``got ...`` of its explanation is the model's own message.
_FAKE_RUN = re.compile(r"got (\w+\(.*\))\s*$", re.MULTILINE)

#: What dynamo says of an exception the model itself raised while it was traced.
_RAISED = re.compile(r"raised exception (\w+\(.*\))\s*$", re.MULTILINE)


class PiecewiseCompiler:
    """The ``torch.compile`` backend: split (and compile the pieces with ``inductor``, if given),
    wrap, report each compilation to ``on_split``."""

    def __init__(self, ops: tuple[torch._ops.OpOverload, ...], on_split: Callable[[SplitSummary], None],
                 inductor: InductorPieces | None = None) -> None:
        self.ops, self.on_split, self.inductor = ops, on_split, inductor
        self.calls = 0
        self.compile_seconds = 0.0  # wall time of the calls that compiled (PiecewiseCompiled)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        self.calls += 1
        unsplit = unsplit_torch_ops(self.ops, gm)
        if unsplit:
            raise PiecewiseCompileError(unsplit_message(unsplit))
        split_gm, summary = split_graph(gm, self.ops, self.inductor, example_inputs)
        self.on_split(summary)
        return SplitProgram(split_gm)


DynamicMode = Literal["auto", "unbacked", "size_oblivious", "backed"]
_MODES = get_args(DynamicMode)


def _size_oblivious() -> contextlib.AbstractContextManager[None]:
    """Trace backed sizes without 0/1 specialization (feature-detected)."""
    config = torch.fx.experimental._config
    if hasattr(config, "backed_size_oblivious"):
        return config.patch(backed_size_oblivious=True)  # type: ignore[attr-defined]
    return contextlib.nullcontext()  # pragma: no cover - older torch: size 1 recompiles once


def _canonical(t: torch.Tensor) -> torch.Tensor:
    """``t``, or for a contiguous ``t`` whose size-1 dims have odd strides, a view with the standard
    strides (dynamo guards on them: ``ids[:, :s]`` of a ``[1, max]`` buffer would recompile)."""
    if not t.is_contiguous():
        return t
    want = torch._prims_common.make_contiguous_strides_for(t.shape)
    return t if t.stride() == want else t.as_strided(t.shape, want)


_capture_size: contextvars.ContextVar[int | None] = contextvars.ContextVar("sglang_bcg_capture_size", default=None)


@contextlib.contextmanager
def capture_size(size: object) -> Iterator[None]:
    """Calls of compiled callables in the body run for a key of capture size ``size`` (an int;
    anything else: unknown)."""
    known = size if isinstance(size, int) and not isinstance(size, bool) else None
    token = _capture_size.set(known)
    try:
        yield
    finally:
        _capture_size.reset(token)


class SizeDims:
    """Which tensor arguments have a size dim at ``dim`` that follows the capture size: those whose
    extent every call of their argument structure found equal to the call's reference (the capture
    size, else the largest extent; 1 tells nothing); marks only shrink (docs/piecewise.md)."""

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
    """``backend.compile(model)``: marks the size dim (``dynamic_dim``) of each tensor argument that follows the capture
    size dynamic, as ``dynamic`` says, then calls the compiled model.

    :raises ValueError: unknown ``dynamic``, or ``dynamic_dim`` not an int >= 0.
    :raises PiecewiseCompileError: (at a call) dynamo could not trace the model as one graph, or not with the size
        dynamic as ``dynamic`` asks (a data-dependent guard, or a call whose size breaks what tracing assumed of it: a
        runtime assertion), or ``splitting_ops`` names torch's own op that the graph never calls."""

    def __init__(self, model: Callable[..., Any], compiler: PiecewiseCompiler, *, dynamic: DynamicMode = "auto",
                 dynamic_dim: int = 0) -> None:
        if dynamic not in _MODES:
            raise ValueError(f"dynamic must be one of {', '.join(map(repr, _MODES))}, got {dynamic!r}")
        if isinstance(dynamic_dim, bool) or not isinstance(dynamic_dim, int) or dynamic_dim < 0:
            msg = f"dynamic_dim must be an int >= 0 (the dim that varies with the capture size), got {dynamic_dim!r}"
            raise ValueError(msg)
        self.original, self.compiler, self.dynamic_dim = model, compiler, dynamic_dim
        if dynamic == "auto":  # made concrete: size-oblivious with Inductor, else unbacked
            dynamic = "size_oblivious" if compiler.inductor is not None else "unbacked"
        self.dynamic = dynamic
        self.size_dims = SizeDims(dynamic_dim)
        self.compiled = torch.compile(model, backend=compiler, fullgraph=True)

    def _mark(self, t: torch.Tensor) -> torch.Tensor:
        t = _canonical(t)
        if self.dynamic == "unbacked":
            torch._dynamo.decorators.mark_unbacked(t, self.dynamic_dim)
        else:
            torch._dynamo.maybe_mark_dynamic(t, self.dynamic_dim)
        return t

    def _why(self, exc: Exception) -> str:
        """The message of a :class:`PiecewiseCompileError` for what dynamo (or the compiled graph) raised."""
        text = str(exc).strip()
        found = _FAKE_RUN.search(text) if isinstance(exc, torch._dynamo.exc.TorchRuntimeError) else None
        first = found.group(1) if found else text.splitlines()[0] if text else type(exc).__name__
        if "Guard fail reason:" in first:  # dynamo's "This is a bug" is this mode's assumption failing
            first = "guard failed: " + first.split("Guard fail reason:", 1)[1].split("  #", 1)[0].strip()
        raised = _RAISED.search(text) if isinstance(exc, torch._dynamo.exc.Unsupported) else None
        if raised:
            return (f"backend.compile(model): the model raised {raised.group(1)} while torch.compile traced it: the "
                    f"code raises so at this size eagerly too. Dynamo's report:\n{exc}")
        if isinstance(exc, torch._dynamo.exc.Unsupported):
            return (f"backend.compile(model): torch.compile must trace the model as one graph (fullgraph=True: "
                    f"work outside it would be missing from the pieces' replay) and could not ({first}). Make code "
                    "that must run eagerly between the pieces a torch.library custom op and list it in "
                    "splitting_ops; a @graph_break function is traced through under Piecewise, it is no split "
                    f"point (docs/piecewise.md). Dynamo's report:\n{exc}")
        if self.dynamic == "backed":
            return f"backend.compile(model): torch.compile could not trace the model ({first}). Dynamo's report:\n{exc}"
        if isinstance(exc, GuardOnDataDependentSymNode) or "data-dependent" in text:
            return (f"backend.compile(model): torch.compile could not trace the model with its size dim {self.dynamic} "
                    f"({first}): the model decides something from a value that depends on the size (transformers' "
                    "mask preparation does, with its stock attention). Pass backend.compile(model, dynamic='backed'), "
                    "which compiles size 1 once more, or move that code into a splitting op "
                    f"(docs/piecewise.md#dynamic-shapes). Dynamo's report:\n{exc}")
        if isinstance(exc, torch._dynamo.exc.UserError):
            return f"backend.compile(model): torch.compile could not trace the model ({first}). Dynamo's report:\n{exc}"
        size = _capture_size.get()
        at = f" (capture size {size})" if size is not None else ""
        return (f"backend.compile(model): a call{at} breaks what torch.compile assumed of the size when it traced "
                f"the model with its size dim {self.dynamic} ({first}): traced that way, one graph serves every size "
                "and asserts what the model's shapes needed of the size at the first call (a multiple of 2, equal to "
                "another extent, not 1), which this size does not meet. If the model runs eagerly at this size, pass "
                "backend.compile(model, dynamic='backed'), which compiles again where the shapes need it; if it "
                "fails eagerly too, the model does not take this size (docs/piecewise.md#dynamic-shapes). "
                f"Torch's report:\n{exc}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, spec = tree_flatten((args, kwargs))
        marks = self.size_dims.marked(leaves, spec)
        if marks:
            leaves = [self._mark(t) if i in marks else t for i, t in enumerate(leaves)]
            args, kwargs = tree_unflatten(leaves, spec)
        calls, start = self.compiler.calls, time.perf_counter()
        # the pieces record their own replay: the eager op tape pauses for the call
        with untracked(), _size_oblivious() if self.dynamic == "size_oblivious" else contextlib.nullcontext():
            try:
                out = self.compiled(*args, **kwargs)
            except torch._dynamo.exc.BackendCompilerFailed as exc:
                if isinstance(exc.inner_exception, PiecewiseCompileError):  # our compile backend's refusal
                    raise exc.inner_exception from None
                raise
            except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError, torch._dynamo.exc.TorchRuntimeError,
                    GuardOnDataDependentSymNode) as exc:
                raise PiecewiseCompileError(self._why(exc)) from exc
            except (RuntimeError, AssertionError) as exc:
                if not any(m in str(exc) for m in _SHAPE_ASSUMPTIONS):
                    raise
                raise PiecewiseCompileError(self._why(exc)) from exc
        if self.compiler.calls != calls:  # this call compiled: charge it, kernels finished
            if torch.cuda.is_initialized():  # pragma: no cover - CUDA only
                torch.cuda.synchronize()
            self.compiler.compile_seconds += time.perf_counter() - start
        return out
