"""``register()``: the ``sglang.srt.plugins`` entry point; installs our HookRegistry hooks.

Which hooks depends on the installed release's seam (:func:`.compat.seam_kind`, found from the
files SGLang ships, without importing them): the flag hooks always; the backend seam's two
resolver hooks (0.5.14+), or the runner seam's two ``BreakableCudaGraphRunner`` hooks (0.5.13).
Registering a target the release does not have would make SGLang log a traceback at startup.

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

from .compat import SeamKind, seam_kind
from .flag import ADD_CLI_ARGS_TARGET, FROM_CLI_ARGS_TARGET, after_add_cli_args, after_from_cli_args
from .runner_seam import CAPTURE_ALL_TARGET, CAPTURE_ONE_TARGET, around_capture_all, around_capture_one
from .seam import DECODE_TARGET, PREFILL_TARGET, around_resolve_decode_backend, around_resolve_prefill_backend

logger = logging.getLogger(__name__)

Hook = tuple[str, Callable[..., Any], str]

#: (HookRegistry target, hook, HookType member name), in registration order: the flag hooks,
#: then the backend seam's (SGLang 0.5.14+).
HOOKS: tuple[Hook, ...] = (
    (ADD_CLI_ARGS_TARGET, after_add_cli_args, "AFTER"),
    (FROM_CLI_ARGS_TARGET, after_from_cli_args, "AFTER"),
    (PREFILL_TARGET, around_resolve_prefill_backend, "AROUND"),
    (DECODE_TARGET, around_resolve_decode_backend, "AROUND"),
)
#: The runner seam's hooks (SGLang 0.5.13), in place of the backend seam's.
RUNNER_HOOKS: tuple[Hook, ...] = (
    (CAPTURE_ALL_TARGET, around_capture_all, "AROUND"),
    (CAPTURE_ONE_TARGET, around_capture_one, "AROUND"),
)


def hooks_for(kind: SeamKind) -> tuple[Hook, ...]:
    """The hooks to register for a seam kind (the flag hooks alone where there is no seam)."""
    if kind == "backend":
        return HOOKS
    return HOOKS[:2] + (RUNNER_HOOKS if kind == "runner" else ())

_lock = threading.Lock()
_registered = False


def register() -> None:
    """Register the flag and backend-seam hooks with SGLang's ``HookRegistry`` (once)."""
    global _registered
    with _lock:
        if _registered:
            return
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        hooks = hooks_for(seam_kind())
        for target, hook, kind in hooks:
            # HookRegistry's own idempotence: never add the same hook to a target twice.
            if any(h is hook for _, h, *_rest in HookRegistry._hooks.get(target, ())):
                continue
            HookRegistry.register(target, hook, HookType[kind])
        _registered = True
        logger.debug("sglang_bcg: registered %d HookRegistry hooks", len(hooks))
