"""What the installed SGLang offers, found by probing its code: the one place per-release
differences live.

Every SGLang release from 0.5.13 to 0.5.23 has a breakable CUDA graph (BCG), reached through one
of two seams:

* ``backend``: ``runner_backend/breakable_cuda_graph_backend.py``'s ``BreakableCudaGraphBackend``
  (0.5.14+), which we subclass (:mod:`.sglang_breakable`);
* ``runner``: ``model_executor/breakable_cuda_graph_runner.py``'s ``BreakableCudaGraphRunner``
  (0.5.13), whose ``_capture_all`` / ``_capture_one`` we wrap (:mod:`.runner_seam`).

Inside the backend seam our capture runs the release's own ``capture_one``, so the releases'
differences there (graph dedup, TP barriers, pool scopes, precarve, the debug form) need no
probe. The few our code still meets are probes of the installed classes (attributes,
``inspect.signature``), never a comparison of version strings; the version is read only to name
the release in messages. :data:`FEATURES` is the table: what each probe looks at and what it
changes.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import sys
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from .builtin import BuiltinPolicy, inspect_builtin, inspect_runner

SeamKind = Literal["backend", "runner", "none"]

BACKEND_MODULE = "sglang.srt.model_executor.runner_backend.breakable_cuda_graph_backend"
BACKEND_CLASS = f"{BACKEND_MODULE}.BreakableCudaGraphBackend"
RUNNER_MODULE = "sglang.srt.model_executor.breakable_cuda_graph_runner"
RUNNER_CLASS = f"{RUNNER_MODULE}.BreakableCudaGraphRunner"
POOL_MODULE = "sglang.srt.model_executor.runner_utils.pool"
RUNNER_BASE = "sglang.srt.model_executor.runner.base_cuda_graph_runner.BaseCudaGraphRunner"
SHAPE_KEY = "sglang.srt.model_executor.runner.shape_key.ShapeKey"

#: (feature, what is probed, what our capture does with it; where it first appeared, for
#: people reading this: it is never compared).
FEATURES: tuple[tuple[str, str, str], ...] = (
    ("dedup_mixin", "the backend has begin_cuda_graph_capture / close",
     "SGLang's session opens dedup registries; the seam closes the replaced instance (0.5.15+)"),
    ("capture_inputs", "capture_one's third parameter is capture_inputs (else dummies)",
     "static inputs are kept with the graph either way, in our per-key record (0.5.17+)"),
    ("global_pool", "runner_utils.pool has get_or_create_global_graph_memory_pool",
     "one process-global graph pool (0.5.15+), else one pool per backend"),
    ("row_hooks", "BaseCudaGraphRunner has cuda_graph_output_rows",
     "rows handed out and buffer capacity from the runner (0.5.21+), else from the output"),
    ("eager_form", "eager_on_graph's first parameter",
     "'enable': eager_on_graph(True)(fn) (<= 0.5.21); 'fn': eager_on_graph(fn) (0.5.22+)"),
)


@dataclass(frozen=True, slots=True)
class Seam:
    """The installed SGLang's breakable graph, as probed."""

    kind: SeamKind
    release: str
    why: str
    builtin: BuiltinPolicy
    dedup_mixin: bool = False
    capture_inputs: bool = False
    global_pool: bool = False
    row_hooks: bool = False
    eager_form: str = "enable"
    shape_key_fields: tuple[str, ...] = ()

    def describe(self) -> str:
        if self.kind == "none":
            return f"SGLang {self.release}: no breakable CUDA graph seam ({self.why})"
        return f"SGLang {self.release}: {self.kind} seam ({self.why})"

    def features(self) -> dict[str, object]:
        return {name: getattr(self, name) for name, _, _ in FEATURES}


def release() -> str:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return "?"


def seam_kind() -> SeamKind:
    """Which seam the installed SGLang has, by file presence (imports no SGLang module)."""
    try:
        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError):
        spec = None
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    for kind, module in (("backend", BACKEND_MODULE), ("runner", RUNNER_MODULE)):
        rel = Path(*module.split(".")[1:]).with_suffix(".py")
        if any((Path(root) / rel).is_file() for root in roots):
            return kind  # type: ignore[return-value]
    return "none"


def _first_param(fn: Callable[..., Any], skip_self: bool = False) -> str | None:
    params = list(inspect.signature(fn).parameters)
    if skip_self:
        params = params[1:]
    return params[0] if params else None


def _has(dotted: str) -> bool:
    module, _, name = dotted.rpartition(".")
    try:
        return hasattr(importlib.import_module(module), name)
    except ImportError:
        return False


def probe_backend(cls: type, module: Any) -> dict[str, object]:
    """The backend-seam features of ``cls`` (SGLang's ``BreakableCudaGraphBackend``) and its module."""
    capture_params = list(inspect.signature(cls.capture_one).parameters)
    key_cls = _resolve(SHAPE_KEY)
    return {
        "dedup_mixin": hasattr(cls, "begin_cuda_graph_capture") and hasattr(cls, "close"),
        "capture_inputs": len(capture_params) > 3 and capture_params[3] == "capture_inputs",
        "global_pool": _has(f"{POOL_MODULE}.get_or_create_global_graph_memory_pool"),
        "row_hooks": _has_attr(RUNNER_BASE, "cuda_graph_output_rows"),
        "eager_form": _first_param(module.eager_on_graph) or "enable",
        "shape_key_fields": tuple(getattr(key_cls, "__dataclass_fields__", {})) if key_cls is not None else (),
    }


def _resolve(dotted: str) -> Any:
    module, _, name = dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


def _has_attr(dotted_class: str, attr: str) -> bool:
    cls = _resolve(dotted_class)
    return cls is not None and hasattr(cls, attr)


@functools.cache
def installed() -> Seam:
    """The installed SGLang's seam (probed once per process; imports SGLang)."""
    kind, version = seam_kind(), release()
    if kind == "backend":
        module = importlib.import_module(BACKEND_MODULE)
        cls = module.BreakableCudaGraphBackend
        return Seam(
            "backend", version, "runner_backend.BreakableCudaGraphBackend, subclassed",
            inspect_builtin(cls), **probe_backend(cls, module),  # type: ignore[arg-type]
        )
    if kind == "runner":
        module = importlib.import_module(RUNNER_MODULE)
        bcg = sys.modules[module.BreakableCUDAGraph.__module__]
        return Seam(
            "runner", version, "model_executor.BreakableCudaGraphRunner._capture_all/_capture_one, wrapped",
            inspect_runner(module.BreakableCudaGraphRunner),
            eager_form=_first_param(bcg.eager_on_graph) or "enable",
            global_pool=hasattr(module, "get_global_graph_memory_pool"),
        )
    return Seam("none", version, f"neither {BACKEND_MODULE} nor {RUNNER_MODULE} exists",
                BuiltinPolicy(None, "no breakable CUDA graph in this SGLang"))


# -- calls whose form differs per release --------------------------------------------------


def eager_break(module: Any, fn: Callable[..., Any], form: str) -> Callable[..., Any]:
    """``fn`` as one eager break of SGLang's segment engine, in the installed form."""
    if form == "enable":
        wrapped: Callable[..., Any] = module.eager_on_graph(True)(fn)
        return wrapped
    wrapped = module.eager_on_graph(fn)
    return wrapped


def capture_var(capture_cls: type) -> ContextVar[Any]:
    """SGLang's "capture in progress" variable, from the module of ``BreakableCUDAGraphCapture``."""
    var: ContextVar[Any] = sys.modules[capture_cls.__module__]._current_capture_var
    return var


def run_outside_capture(capture_cls: type, forward_fn: Callable[[], Any]) -> Any:
    """Run ``forward_fn`` with SGLang's capture variable unset (its own breaks run inline)."""
    var = capture_var(capture_cls)
    token = var.set(None)
    try:
        return forward_fn()
    finally:
        var.reset(token)


def num_segments(graph: Any) -> int:
    """Segments of SGLang's ``BreakableCUDAGraph`` (1 where the graph does not say)."""
    segments = getattr(graph, "_segments", None)
    return len(segments) if segments is not None else 1


def runner_rows(runner: Any, output: Any) -> tuple[object, object]:
    """``(cuda_graph_output_rows, cuda_graph_output_capacity_rows)`` of ``runner`` for ``output``;
    ``None`` for a hook the release (or the runner) does not have."""
    rows = getattr(runner, "cuda_graph_output_rows", None)
    capacity = getattr(runner, "cuda_graph_output_capacity_rows", None)
    return (rows(output) if rows is not None else None, capacity(output) if capacity is not None else None)


def pool_borrowing_exists() -> bool:
    """Whether this SGLang lends free graph-pool blocks to eager tensors (``borrow_graph_pool``)."""
    return _has(f"{POOL_MODULE}.borrow_graph_pool")


def sglang_builtin_policy() -> BuiltinPolicy:
    """What the installed SGLang's own breakable graph does with outputs (our default there)."""
    try:
        return installed().builtin
    except Exception as exc:  # noqa: BLE001 - any import failure means "cannot tell"
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
        return BuiltinPolicy(None, f"SGLang's breakable graph does not import ({type(exc).__name__}: {first})")


def sglang_builtin_shares() -> bool | None:
    """Whether the installed SGLang's built-in BCG shares outputs (``None``: cannot tell)."""
    return sglang_builtin_policy().shares


#: The names SGLang gives ``capture_one``'s third parameter: ``dummies`` (0.5.14-0.5.16, whose
#: runners pass ``dummies=None``), ``capture_inputs`` (0.5.17 and later).
CAPTURE_INPUT_NAMES = ("capture_inputs", "dummies")


def capture_one_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Callable[[], None] | None]:
    """``(capture_inputs, post_warmup_hook)`` from what a runner passed after ``(shape_key, forward_fn)``,
    under any release's parameter names (:data:`CAPTURE_INPUT_NAMES`).

    :raises TypeError: too many arguments, one given twice, or a keyword no release has.
    """
    if len(args) > 2:
        msg = f"capture_one() takes at most 4 arguments after self ({len(args) + 2} given)"
        raise TypeError(msg)
    given = dict(zip(("capture_inputs", "post_warmup_hook"), args, strict=False))
    for name, value in kwargs.items():
        slot = "capture_inputs" if name in CAPTURE_INPUT_NAMES else name
        if slot not in ("capture_inputs", "post_warmup_hook"):
            msg = f"capture_one() got an unexpected keyword argument {name!r}"
            raise TypeError(msg)
        if slot in given:
            msg = f"capture_one() got multiple values for argument {slot!r}"
            raise TypeError(msg)
        given[slot] = value
    return given.get("capture_inputs"), given.get("post_warmup_hook")
