"""The backend seam: AROUND hooks on SGLang's ``resolve_prefill_backend`` / ``resolve_decode_backend``
replace SGLang's own breakable backend (docs/sglang.md, "Routing a phase to another backend")."""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
from collections.abc import Callable
from typing import Any

from ..backends.base import CaptureBackend
from ..manager import get_plugin_manager
from ..options import BackendOptions
from ..registry import build_registry
from ..report import MemoryReport
from .compat import BACKEND_MODULE, capture_one_args
from .sglang_breakable import sglang_breakable_backend_class
from .sglang_session import runner_server_args

logger = logging.getLogger(__name__)

#: HookRegistry targets of the two AROUND hooks.
PREFILL_TARGET = "sglang.srt.model_executor.runner_backend.utils.resolve_prefill_backend"
DECODE_TARGET = "sglang.srt.model_executor.runner_backend.utils.resolve_decode_backend"
BASE_MODULE = "sglang.srt.model_executor.runner_backend.base_cuda_graph_backend"


def swap_backend(phase: str, backend: Any, cuda_graph_runner: Any) -> Any:
    """Replace SGLang's own breakable backend by the one ``sglang_bcg_select_backend`` picks: ours
    (``None`` or ``"breakable"``), a registered SGLang backend class, or ours behind the adapter."""
    if type(backend) is not importlib.import_module(BACKEND_MODULE).BreakableCudaGraphBackend:
        return backend  # Full and platform backends: SGLang's choice, unchanged
    adapter = getattr(backend, "_memory_saver_adapter", None)
    kwargs = {
        "enable_memory_saver": bool(getattr(adapter, "enabled", False)),
        "debug_eager": bool(getattr(backend, "_debug_eager", False)),
    }
    close = getattr(backend, "close", None)  # the dedup mixin's (SGLang 0.5.15+)
    if close is not None:
        close()  # SGLang's instance captured nothing; drop its (empty) dedup registries
    server_args = runner_server_args(cuda_graph_runner)
    pm = get_plugin_manager()
    name = pm.hook.sglang_bcg_select_backend(phase=phase, server_args=server_args)
    if name is None or name == "breakable":
        chosen: Any = sglang_breakable_backend_class()(cuda_graph_runner, **kwargs)
    else:
        factory = build_registry(pm).get(name)
        if isinstance(factory, type) and issubclass(factory, importlib.import_module(BASE_MODULE).BaseCudaGraphBackend):
            chosen = factory(cuda_graph_runner, **kwargs)
        else:
            ours = factory(options=BackendOptions(), plugin_manager=pm)
            chosen = sglang_adapter_class()(ours, cuda_graph_runner)
    logger.debug("sglang_bcg: %s backend %s (selected %r)", phase, type(chosen).__qualname__, name)
    return chosen


def around_resolve_prefill_backend(
    original_fn: Callable[..., Any], cuda_graph_runner: Any, *args: Any, **kwargs: Any
) -> Any:
    """AROUND hook of ``resolve_prefill_backend``."""
    return swap_backend("prefill", original_fn(cuda_graph_runner, *args, **kwargs), cuda_graph_runner)


def around_resolve_decode_backend(
    original_fn: Callable[..., Any], cuda_graph_runner: Any, *args: Any, **kwargs: Any
) -> Any:
    """AROUND hook of ``resolve_decode_backend``."""
    return swap_backend("decode", original_fn(cuda_graph_runner, *args, **kwargs), cuda_graph_runner)


class CaptureBackendAdapterMixin:
    """SGLang's six-method backend contract, forwarded to one of our :class:`CaptureBackend`."""

    def __init__(self, backend: CaptureBackend, cuda_graph_runner: object = None) -> None:
        self.backend = backend
        self._cuda_graph_runner = cuda_graph_runner

    def capture_session(self, stream: Any) -> contextlib.AbstractContextManager[None]:
        return self.backend.capture_session(stream)

    def capture_one(self, shape_key: Any, forward_fn: Callable[[], Any], *args: Any, **kwargs: Any) -> None:
        """``(capture_inputs, post_warmup_hook)`` under any release's names (``dummies`` up to 0.5.16)."""
        self.backend.capture_one(shape_key, forward_fn, *capture_one_args(args, kwargs))

    def can_run(self, forward_batch: Any, shape_key: Any) -> bool:
        return self.backend.can_run(shape_key)

    def replay_session(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def replay(self, shape_key: Any, static_forward_batch: Any, **kwargs: Any) -> Any:
        return self.backend.replay(shape_key)

    def cleanup(self) -> None:
        self.backend.cleanup()

    def memory_report(self) -> MemoryReport:
        return self.backend.memory_report()


@functools.cache
def sglang_adapter_class() -> type[Any]:
    """The adapter class: our mixin over SGLang's ``BaseCudaGraphBackend`` (built once)."""
    base = importlib.import_module(BASE_MODULE).BaseCudaGraphBackend
    return type("CaptureBackendAdapter", (CaptureBackendAdapterMixin, base),
                {"__module__": __name__, "__doc__": CaptureBackendAdapterMixin.__doc__})
