"""What our capture will call on the installed SGLang, as checks ``sglang-bcg doctor`` prints.

Each check names one thing the backend (or the runner hook) really calls or reads, for the
seam and features :func:`.compat.installed` found: a name, a signature, an attribute SGLang's
constructor sets, a call in SGLang's own capture loop our hook relies on. A check returns ``None``
when it holds, else why not, so doctor never says ok where a capture would fail.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from .compat import code_names
from .compat import BACKEND_CLASS, BACKEND_MODULE, RUNNER_CLASS, RUNNER_MODULE, Seam
from .sglang_breakable import unknown_capture_helpers

Check = tuple[str, Callable[[], str | None]]

#: Attributes SGLang's ``BreakableCudaGraphBackend.__init__`` must set (our capture reads them).
BACKEND_ATTRS = ("_graphs", "_outputs", "_pool", "_debug_eager")


def _obj(dotted: str) -> Any:
    module, _, rest = dotted.partition(":")
    obj: Any = importlib.import_module(module)
    for part in rest.split(".") if rest else []:
        obj = getattr(obj, part)
    return obj


def _params(dotted: str, *names: str) -> Callable[[], str | None]:
    def check() -> str | None:
        have = list(inspect.signature(_obj(dotted)).parameters)
        missing = [n for n in names if n not in have]
        return f"parameters {missing} missing from ({', '.join(have)})" if missing else None

    return check


def _source_has(dotted: str, *needles: str) -> Callable[[], str | None]:
    def check() -> str | None:
        try:
            source = inspect.getsource(_obj(dotted))
        except (OSError, TypeError) as exc:
            return f"cannot read the source ({type(exc).__name__})"
        missing = [n for n in needles if n not in source]
        return f"does not contain {missing}" if missing else None

    return check


def _exists(dotted: str) -> Callable[[], str | None]:
    def check() -> str | None:
        _obj(dotted)
        return None

    return check


def _colon(dotted_class: str) -> str:
    module, _, cls = dotted_class.rpartition(".")
    return f"{module}:{cls}"


def backend_checks(seam: Seam) -> list[Check]:
    cls, mod = _colon(BACKEND_CLASS), f"{BACKEND_MODULE}:"
    inputs = "capture_inputs" if seam.capture_inputs else "dummies"
    return [
        (f"{BACKEND_CLASS}.__init__(cuda_graph_runner, *, enable_memory_saver, debug_eager)",
         _params(f"{cls}.__init__", "cuda_graph_runner", "enable_memory_saver", "debug_eager")),
        (f"{BACKEND_CLASS}.__init__ sets {', '.join(BACKEND_ATTRS)}", _uses(f"{cls}.__init__", *BACKEND_ATTRS)),
        (f"{BACKEND_CLASS}.capture_session / replay / cleanup",
         lambda: next((f"no {m}" for m in ("capture_session", "replay", "cleanup") if not hasattr(_obj(cls), m)), None)),
        (f"{BACKEND_CLASS}.capture_one(shape_key, forward_fn, {inputs}, post_warmup_hook)",
         _params(f"{cls}.capture_one", "shape_key", "forward_fn", inputs, "post_warmup_hook")),
        (f"{BACKEND_CLASS}.capture_one keeps outputs only through the helpers sglang_bcg overrides",
         lambda: (f"uses {u}, unknown to sglang_bcg" if (u := unknown_capture_helpers(_obj(f"{cls}.capture_one"))) else None)),
        (f"{BACKEND_MODULE}.BreakableCUDAGraphCapture(cuda_graph, pool, stream)",
         _params(f"{mod}BreakableCUDAGraphCapture.__init__", "cuda_graph", "pool", "stream")),
        (f"{BACKEND_MODULE}.BreakableCUDAGraph's module: _current_capture_var", _capture_var_check(f"{mod}BreakableCUDAGraph")),
        ("sglang.srt.model_executor.runner_backend.base_cuda_graph_backend.BaseCudaGraphBackend",
         _exists("sglang.srt.model_executor.runner_backend.base_cuda_graph_backend:BaseCudaGraphBackend")),
    ]


def _uses(dotted: str, *names: str) -> Callable[[], str | None]:
    def check() -> str | None:
        used = code_names(_obj(dotted)) or frozenset()
        missing = [n for n in names if n not in used]
        return f"does not use {missing}" if missing else None

    return check


def _capture_var_check(engine_cls: str) -> Callable[[], str | None]:
    def check() -> str | None:
        import sys

        module = sys.modules[_obj(engine_cls).__module__]
        return None if hasattr(module, "_current_capture_var") else f"{module.__name__} has no _current_capture_var"

    return check


def runner_checks(seam: Seam) -> list[Check]:
    cls = _colon(RUNNER_CLASS)
    return [
        (f"{RUNNER_CLASS}._capture_one(num_tokens, pool, stream)", _params(f"{cls}._capture_one", "num_tokens", "pool", "stream")),
        (f"{RUNNER_CLASS}._capture_one runs self._run_forward inside BreakableCUDAGraphCapture",
         _source_has(f"{cls}._capture_one", "self._run_forward(", "BreakableCUDAGraphCapture(")),
        (f"{RUNNER_CLASS}._capture_all stores output_buffers[num_tokens] from _capture_one",
         _source_has(f"{cls}._capture_all", "self._capture_one(", "self.output_buffers[num_tokens] = output")),
        (f"{RUNNER_CLASS}.replay returns output_buffers[static_num_tokens]",
         _source_has(f"{cls}.replay", "self.output_buffers[static_num_tokens]")),
        (f"{RUNNER_MODULE}.BreakableCUDAGraphCapture's module: _current_capture_var", _capture_var_check(f"{RUNNER_MODULE}:BreakableCUDAGraphCapture")),
    ]


def seam_checks(seam: Seam) -> list[Check]:
    """The checks for ``seam`` (none where the release has no seam: doctor reports that itself)."""
    if seam.kind == "backend":
        return backend_checks(seam)
    if seam.kind == "runner":
        return runner_checks(seam)
    return []
