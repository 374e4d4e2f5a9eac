"""``register()``: the ``sglang.srt.plugins`` entry point; installs our HookRegistry hooks.

SGLang's ``load_plugins()`` calls it once in every process that loads plugins (main, scheduler
and TP workers, DP controller, detokenizer; not Ray actors), then ``HookRegistry.apply_hooks()``
patches the targets. Registering is cheap (SGLang's hook registry is already imported by the
caller; nothing heavy is imported) and idempotent. Errors are not caught here: SGLang logs and
swallows plugin errors, and ``sglang-bcg doctor`` reports a moved target.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from .flag import ADD_CLI_ARGS_TARGET, FROM_CLI_ARGS_TARGET, after_add_cli_args, after_from_cli_args
from .seam import DECODE_TARGET, PREFILL_TARGET, around_resolve_decode_backend, around_resolve_prefill_backend

logger = logging.getLogger(__name__)

#: (HookRegistry target, hook, HookType member name), in registration order.
HOOKS: tuple[tuple[str, Callable[..., Any], str], ...] = (
    (ADD_CLI_ARGS_TARGET, after_add_cli_args, "AFTER"),
    (FROM_CLI_ARGS_TARGET, after_from_cli_args, "AFTER"),
    (PREFILL_TARGET, around_resolve_prefill_backend, "AROUND"),
    (DECODE_TARGET, around_resolve_decode_backend, "AROUND"),
)

_lock = threading.Lock()
_registered = False


def register() -> None:
    """Register the flag and backend-seam hooks with SGLang's ``HookRegistry`` (once)."""
    global _registered
    with _lock:
        if _registered:
            return
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        for target, hook, kind in HOOKS:
            # HookRegistry's own idempotence: never add the same hook to a target twice.
            if any(h is hook for _, h, *_rest in HookRegistry._hooks.get(target, ())):
                continue
            HookRegistry.register(target, hook, HookType[kind])
        _registered = True
        logger.debug("sglang_bcg: registered %d HookRegistry hooks", len(HOOKS))
