"""``register()``: the ``sglang.srt.plugins`` entry point; installs the HookRegistry hooks the
installed release's seam (:func:`.compat.seam_kind`) and this process (:func:`wanted`) need."""

from __future__ import annotations

import importlib.util
import logging
import multiprocessing
import sys
import threading
from collections.abc import Callable
from typing import Any

from .compat import SeamKind, seam_kind, sglang_source
from . import incremental, memory_plan
from .flag import ADD_CLI_ARGS_TARGET, FROM_CLI_ARGS_TARGET, after_add_cli_args, after_from_cli_args
from .runner_seam import CAPTURE_ALL_TARGET, CAPTURE_ONE_TARGET, around_capture_all, around_capture_one
from .sglang_breakable import (DECODE_TARGET, PREFILL_TARGET, around_resolve_decode_backend,
                               around_resolve_prefill_backend)
from .switch.routes import HTTP_TARGET, before_setup_and_run_http_server
from .switch.rpc import RPC_TARGET, around_handle_rpc_request

logger = logging.getLogger(__name__)

Hook = tuple[str, Callable[..., Any], str]

#: (HookRegistry target, hook, HookType member name): the flag's, the live switch's, the backend seam's (0.5.14+).
HOOKS: tuple[Hook, ...] = (
    (ADD_CLI_ARGS_TARGET, after_add_cli_args, "AFTER"),
    (FROM_CLI_ARGS_TARGET, after_from_cli_args, "AFTER"),
    (HTTP_TARGET, before_setup_and_run_http_server, "BEFORE"),
    (RPC_TARGET, around_handle_rpc_request, "AROUND"),
    (PREFILL_TARGET, around_resolve_prefill_backend, "AROUND"),
    (DECODE_TARGET, around_resolve_decode_backend, "AROUND"),
    (memory_plan.RESIZE_TARGET, memory_plan.around_post_capture_resize, "AROUND"),
    (incremental.START_TARGET, incremental.around_capture, "AROUND"),
    (incremental.CAPTURE_TARGET, incremental.around_capture_one_stream, "AROUND"),
    (incremental.CAN_RUN_TARGET, incremental.around_can_run_graph, "AROUND"),
    (incremental.STEP_TARGET, incremental.before_next_batch, "AROUND"),
)
#: The runner seam's hooks (SGLang 0.5.13), in place of the backend seam's.
RUNNER_HOOKS: tuple[Hook, ...] = (
    (CAPTURE_ALL_TARGET, around_capture_all, "AROUND"),
    (CAPTURE_ONE_TARGET, around_capture_one, "AROUND"),
)

#: target -> whether this process registers it: the HTTP hook in the launcher (not a multiprocessing
#: child, FastAPI installed), the RPC hook in schedulers (they import the scheduler before plugins), the memory
#: plan's where it is asked (turning SGLang's post-capture KV sizing on) and the release has that sizing, the
#: incremental capture's where it is asked and the release's prefill runner has the methods it hooks.
WHERE: dict[str, Callable[[], bool]] = {
    HTTP_TARGET: lambda: multiprocessing.parent_process() is None and importlib.util.find_spec("fastapi") is not None,
    RPC_TARGET: lambda: "sglang.srt.managers.scheduler" in sys.modules,
    memory_plan.RESIZE_TARGET: lambda: has_post_capture_sizing() and memory_plan.prepare(),
    incremental.START_TARGET: incremental.wanted,
    incremental.CAPTURE_TARGET: incremental.wanted,
    incremental.CAN_RUN_TARGET: incremental.wanted,
    incremental.STEP_TARGET: incremental.wanted,
}


def hooks_for(kind: SeamKind) -> tuple[Hook, ...]:
    """The hooks of a seam kind: the flag's alone without a seam; on the runner seam, the switch's too."""
    return {"backend": HOOKS, "runner": HOOKS[:4] + RUNNER_HOOKS}.get(kind, HOOKS[:2])



def has_post_capture_sizing() -> bool:
    """Whether the installed SGLang backs its KV pool after capture (0.5.16+), read from its source unimported."""
    source = sglang_source(memory_plan.RUNTIME_MODULE)
    return source is not None and "def compute_post_capture_kv_resize" in source.read_text()


def wanted(target: str) -> bool:
    """Whether this process registers ``target`` (:data:`WHERE`; any other hook: yes)."""
    return target not in WHERE or WHERE[target]()


_lock = threading.Lock()
_registered = False


def register() -> None:
    """Register the hooks with SGLang's ``HookRegistry`` (once; never one hook twice on a target)."""
    global _registered
    with _lock:
        if _registered:
            return
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        hooks = tuple(h for h in hooks_for(seam_kind()) if wanted(h[0]))
        for target, hook, kind in hooks:
            if not any(h is hook for _, h, *_rest in HookRegistry._hooks.get(target, ())):
                HookRegistry.register(target, hook, HookType[kind])
        _registered = True
        logger.debug("sglang_bcg: registered %d HookRegistry hooks", len(hooks))
