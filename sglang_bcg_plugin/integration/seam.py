"""The backend seam: AROUND hooks on SGLang's ``resolve_prefill_backend`` / ``resolve_decode_backend``.

SGLang's ``runner_backend/utils.py`` is the documented place for out-of-tree backends. Each hook
calls SGLang's resolver (``original_fn``: never a module global, since HookRegistry rebinds every
module attribute that held the original), then:

* SGLang returned exactly its ``BreakableCudaGraphBackend`` → ask the pluggy hook
  ``sglang_bcg_select_backend(phase, server_args)``; ``None`` or ``"breakable"`` gives our
  :func:`~sglang_bcg_plugin.integration.sglang_breakable_backend_class` built with the same
  ``debug_eager`` / memory-saver setting; another name routes the phase to that registered backend
  (a registered subclass of SGLang's ``BaseCudaGraphBackend`` is built with SGLang's breakable
  constructor signature, anything else runs behind :mod:`.adapter`);
* anything else (Full, NPU, XPU, out-of-tree platform backends, subclasses installed by other
  plugins) is returned unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..manager import get_plugin_manager
from ..options import BackendOptions
from ..registry import build_registry
from .adapter import sglang_adapter_class
from .sglang_breakable import SGLANG_BCG_CLASS, sglang_breakable_backend_class
from .sglang_session import runner_server_args

logger = logging.getLogger(__name__)

#: HookRegistry targets of the two AROUND hooks.
PREFILL_TARGET = "sglang.srt.model_executor.runner_backend.utils.resolve_prefill_backend"
DECODE_TARGET = "sglang.srt.model_executor.runner_backend.utils.resolve_decode_backend"


def _sglang_bcg_class() -> Any:
    import pkgutil

    return pkgutil.resolve_name(SGLANG_BCG_CLASS)


def swap_backend(phase: str, backend: Any, cuda_graph_runner: Any) -> Any:
    """Replace SGLang's own breakable backend by the one our configuration selects."""
    if type(backend) is not _sglang_bcg_class():
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
        from sglang.srt.model_executor.runner_backend.base_cuda_graph_backend import BaseCudaGraphBackend

        factory = build_registry(pm).get(name)
        if isinstance(factory, type) and issubclass(factory, BaseCudaGraphBackend):
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
