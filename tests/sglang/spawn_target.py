"""Target of the spawned "scheduler-like" process of ``test_flag_reaches_spawned_child``."""

from __future__ import annotations

import os
from typing import Any

import torchvision_standin

# At import, before the pickled ServerArgs is loaded: releases up to 0.5.21 import torchvision
# while unpickling it.
torchvision_standin.install()


def scheduler_like(server_args: Any, queue: Any) -> None:
    """What an SGLang scheduler process does first: load plugins; then read our switch."""
    import warnings

    warnings.simplefilter("ignore")
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_bcg_plugin import resolve_output_mode

    load_plugins()
    queue.put({
        # private: SGLang's HookRegistry has no public read of what it patched
        "plugins_patched": "sglang.srt.server_args.ServerArgs.from_cli_args" in HookRegistry._patched,
        "env": os.environ.get("SGLANG_ENABLE_BCG_SHARED_OUTPUT"),
        "stash": getattr(server_args, "_bcg_shared_output", None),
        "mode": resolve_output_mode(),
    })
