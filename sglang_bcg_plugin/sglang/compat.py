"""What the installed SGLang offers, probed from its classes (never from version strings): the one place per-release
differences live (docs/sglang.md#what-differs-between-releases), and the integration's environment variables."""

from __future__ import annotations

import functools
import importlib.util
import inspect
import sys
import types
import warnings
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from .._version import package_version
from ..errors import one_line
from ..output.mode import OFF, ON, OutputMode

SeamKind = Literal["backend", "runner", "none"]

#: Turns the stale-output guard on for the SGLang-integrated backend (it has no ``BackendOptions``).
ENV_STALE_OUTPUT_GUARD = "SGLANG_BCG_STALE_OUTPUT_GUARD"
#: Where that backend's shared buffer comes from, ``adopt`` or ``reserve`` (unset: ``reserve``).
ENV_SHARED_BUFFER = "SGLANG_BCG_SHARED_BUFFER"
#: ``1``: the graph memory forecast lines in SGLang's log (:mod:`.forecast_log`); off by default.
ENV_FORECAST = "SGLANG_BCG_FORECAST"
#: A JSON file: per size, what the capture took from free memory, the pool and the driver.
ENV_FORECAST_TRACE = "SGLANG_BCG_FORECAST_TRACE"

BACKEND_MODULE = "sglang.srt.model_executor.runner_backend.breakable_cuda_graph_backend"
BACKEND_CLASS = f"{BACKEND_MODULE}.BreakableCudaGraphBackend"
RUNNER_MODULE = "sglang.srt.model_executor.breakable_cuda_graph_runner"
RUNNER_CLASS = f"{RUNNER_MODULE}.BreakableCudaGraphRunner"
POOL_MODULE = "sglang.srt.model_executor.runner_utils.pool"
RUNNER_BASE = "sglang.srt.model_executor.runner.base_cuda_graph_runner.BaseCudaGraphRunner"
#: The name SGLang's breakable graph under our output policy reports (state, memory report, errors) on either
#: seam; ``"breakable"`` is the plugin's own ``BreakableBackend``.
SGLANG_BREAKABLE = "sglang-breakable"

#: The probed features, printed by ``sglang-bcg doctor`` (what each probes and changes: docs/sglang.md,
#: "What differs between releases").
FEATURES = ("dedup_mixin", "capture_inputs", "global_pool", "row_hooks", "eager_form")
#: Names whose use in SGLang's ``capture_one`` means "copies every output into one buffer".
SHARING_NAMES = ("_shared_output_buffer", "_copy_output_to_buffer")
#: Used too when the buffer comes from the warmup (0.5.16+); without it the first output is adopted.
WARMUP_BUFFER = "_alloc_full_buffer"
#: Words that would make that sharing conditional (then we cannot tell what SGLang does).
SWITCH_WORDS = ("share_output", "enable_bcg", "reuse_output")


@dataclass(frozen=True, slots=True)
class BuiltinPolicy:
    """Whether SGLang's built-in BCG shares outputs (``None``: cannot tell) and why."""

    shares: bool | None
    reason: str

    @property
    def default_mode(self) -> OutputMode:
        return ON if self.shares else OFF

    def default_reason(self) -> str:
        return f"default: {self.default_mode}, the installed SGLang's own behaviour: {self.reason}"


def code_names(fn: object) -> frozenset[str] | None:
    """The names ``fn``'s compiled code uses (attributes, globals, string constants), nested
    functions included; ``None`` when ``fn`` has no Python code (a builtin, a missing name)."""
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    if code is None:
        return None
    codes = [code]
    for c in codes:  # nested code joins the walk
        codes += [k for k in c.co_consts if isinstance(k, types.CodeType)]
    return frozenset(n for c in codes for n in (*c.co_names, *c.co_consts) if isinstance(n, str))


def inspect_builtin(cls: type) -> BuiltinPolicy:
    """Read ``cls`` (SGLang's ``BreakableCudaGraphBackend`` or a stand-in) for its output policy."""
    name = cls.__qualname__
    capture, init = code_names(getattr(cls, "capture_one", None)), code_names(getattr(cls, "__init__", None))
    if capture is None or init is None:
        return BuiltinPolicy(None, f"cannot read {name}'s code; assuming it does not share")
    if not all(n in capture for n in SHARING_NAMES) or SHARING_NAMES[0] not in init:
        return BuiltinPolicy(False, f"{name}.capture_one keeps one output per shape key")
    switches = ", ".join(w for w in SWITCH_WORDS if w in " ".join(capture).lower())
    if switches:
        return BuiltinPolicy(None, f"{name}.capture_one shares under a switch ({switches}) this plugin does not know; "
                                   "assuming off")
    how = ("always copies outputs into one _shared_output_buffer" if WARMUP_BUFFER in capture
           else "adopts the first capture's output as one _shared_output_buffer and copies the others into it")
    return BuiltinPolicy(True, f"{name}.capture_one {how}")


def inspect_runner(cls: type) -> BuiltinPolicy:
    """Read SGLang 0.5.13's ``BreakableCudaGraphRunner`` (or a stand-in) for its output policy."""
    name = cls.__qualname__
    found = [n for n in map(code_names, vars(cls).values()) if n is not None]
    if not found:
        return BuiltinPolicy(None, f"cannot read {name}'s code; assuming it does not share")
    if any(s in names for names in found for s in SHARING_NAMES):
        return BuiltinPolicy(None, f"{name} shares outputs in a way this plugin does not know; assuming off")
    return BuiltinPolicy(False, f"{name}._capture_all keeps one output_buffers entry per size")


@dataclass(frozen=True, slots=True)
class Seam:
    """The installed SGLang's breakable graph, as probed."""

    kind: SeamKind
    release: str
    why: str
    builtin: BuiltinPolicy
    eager_form: str = "enable"
    global_pool: bool = False
    dedup_mixin: bool = False
    capture_inputs: bool = False
    row_hooks: bool = False

    def describe(self) -> str:
        seam = "no breakable CUDA graph seam" if self.kind == "none" else f"{self.kind} seam"
        return f"SGLang {self.release}: {seam} ({self.why})"

    def features(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in FEATURES}


def sglang_source(module: str) -> Path | None:
    """The source file of ``module`` of the installed top package, found without importing it."""
    try:  # the top package only: find_spec of a submodule would import its parents
        spec = importlib.util.find_spec(module.split(".", 1)[0])
    except (ImportError, ValueError):
        return None
    rel = Path(*module.split(".")[1:]).with_suffix(".py")
    roots = (spec.submodule_search_locations or []) if spec is not None else []
    return next((Path(root) / rel for root in roots if (Path(root) / rel).is_file()), None)


def seam_kind() -> SeamKind:
    """Which seam the installed SGLang has, by file presence (imports no SGLang module)."""
    if sglang_source(BACKEND_MODULE) is not None:
        return "backend"
    return "runner" if sglang_source(RUNNER_MODULE) is not None else "none"


def _eager_form(eager_on_graph: Callable[..., Any]) -> str:
    """How a release's ``eager_on_graph`` is called: by the name of its first parameter."""
    return next(iter(inspect.signature(eager_on_graph).parameters), "enable")


def _resolve(dotted: str) -> Any:
    """``module.name`` (``None`` where the module does not import or has no such name)."""
    module, _, name = dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


@functools.cache
def installed() -> Seam:
    """The installed SGLang's seam (probed once per process; imports SGLang)."""
    kind, version = seam_kind(), package_version("sglang", "?")
    if kind == "backend":
        cls = (module := importlib.import_module(BACKEND_MODULE)).BreakableCudaGraphBackend
        return Seam("backend", version, "runner_backend.BreakableCudaGraphBackend, subclassed", inspect_builtin(cls),
                    dedup_mixin=hasattr(cls, "begin_cuda_graph_capture") and hasattr(cls, "close"),
                    capture_inputs=list(inspect.signature(cls.capture_one).parameters)[3:4] == ["capture_inputs"],
                    global_pool=_resolve(f"{POOL_MODULE}.get_or_create_global_graph_memory_pool") is not None,
                    row_hooks=hasattr(_resolve(RUNNER_BASE), "cuda_graph_output_rows"),
                    eager_form=_eager_form(module.eager_on_graph))
    if kind == "runner":
        module = importlib.import_module(RUNNER_MODULE)
        return Seam("runner", version, "model_executor.BreakableCudaGraphRunner._capture_all/_capture_one, wrapped",
                    inspect_runner(module.BreakableCudaGraphRunner),
                    eager_form=_eager_form(sys.modules[module.BreakableCUDAGraph.__module__].eager_on_graph),
                    global_pool=hasattr(module, "get_global_graph_memory_pool"))
    return Seam("none", version, f"neither {BACKEND_MODULE} nor {RUNNER_MODULE} exists",
                BuiltinPolicy(None, "no breakable CUDA graph in this SGLang"))


def eager_break(module: Any, fn: Callable[..., Any], form: str) -> Callable[..., Any]:
    """``fn`` as one eager break of SGLang's segment engine, in the installed form."""
    return module.eager_on_graph(True)(fn) if form == "enable" else module.eager_on_graph(fn)


def capture_var(capture_cls: type) -> ContextVar[Any]:
    """SGLang's "capture in progress" variable, from the module of ``BreakableCUDAGraphCapture``."""
    return sys.modules[capture_cls.__module__]._current_capture_var


def run_outside_capture(capture_cls: type, forward_fn: Callable[[], Any]) -> Any:
    """Run ``forward_fn`` with SGLang's capture variable unset (its own breaks run inline)."""
    token = (var := capture_var(capture_cls)).set(None)
    try:
        return forward_fn()
    finally:
        var.reset(token)


def num_segments(graph: Any) -> int:
    """Segments of SGLang's ``BreakableCUDAGraph`` (1 where the graph does not say)."""
    return 1 if (segments := getattr(graph, "_segments", None)) is None else len(segments)


def runner_rows(runner: Any, output: Any) -> tuple[object, object]:
    """``(cuda_graph_output_rows, cuda_graph_output_capacity_rows)`` of ``runner`` for ``output``;
    ``None`` for a hook the release (or the runner) does not have."""
    hooks = (getattr(runner, name, None) for name in ("cuda_graph_output_rows", "cuda_graph_output_capacity_rows"))
    return tuple(None if hook is None else hook(output) for hook in hooks)  # type: ignore[return-value]


def pool_borrowing_exists() -> bool:
    """Whether this SGLang lends free graph-pool blocks to eager tensors (``borrow_graph_pool``)."""
    return _resolve(f"{POOL_MODULE}.borrow_graph_pool") is not None


def sglang_builtin_policy() -> BuiltinPolicy:
    """What the installed SGLang's own breakable graph does with outputs (our default there)."""
    try:
        return installed().builtin
    except Exception as exc:  # noqa: BLE001 - any import failure means "cannot tell"
        return BuiltinPolicy(None, f"SGLang's breakable graph does not import ({type(exc).__name__}: {one_line(exc)})")


def capture_one_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Callable[[], None] | None]:
    """``(capture_inputs, post_warmup_hook)`` from what a runner passed after the key and forward
    (``dummies``: 0.5.14-0.5.16's ``capture_inputs``). :raises TypeError: as Python would."""
    if len(args) > 2:
        raise TypeError(f"capture_one() takes at most 4 arguments after self ({len(args) + 2} given)")
    given = dict(zip(("capture_inputs", "post_warmup_hook"), args, strict=False))
    for name, value in kwargs.items():
        slot = "capture_inputs" if name == "dummies" else name
        if slot in given or slot not in ("capture_inputs", "post_warmup_hook"):
            raise TypeError(f"capture_one() got multiple values for argument {slot!r}" if slot in given
                            else f"capture_one() got an unexpected keyword argument {name!r}")
        given[slot] = value
    return given.get("capture_inputs"), given.get("post_warmup_hook")


def tp_group() -> Any:
    """SGLang's tensor-parallel group coordinator where there are two ranks or more (``None``: one process)."""
    try:
        with warnings.catch_warnings():  # 0.5.23 deprecates the name; the group is the same
            warnings.simplefilter("ignore", DeprecationWarning)
            group = importlib.import_module("sglang.srt.distributed.parallel_state").get_tp_group()
    except (ImportError, AttributeError, AssertionError, RuntimeError, ValueError):  # no TP group: one process
        return None
    return group if getattr(group, "world_size", 1) > 1 else None


def tp_agree(value: int, *, largest: bool) -> int:
    """``value`` agreed over the tensor-parallel ranks (each calls this at the same point): the largest, or
    with ``largest=False`` the smallest; this rank's own without a TP group."""
    group = tp_group()
    if group is None:
        return value
    vote = torch.tensor([value], dtype=torch.int64)
    op = torch.distributed.ReduceOp.MAX if largest else torch.distributed.ReduceOp.MIN
    torch.distributed.all_reduce(vote, op=op, group=group.cpu_group)
    return int(vote.item())
