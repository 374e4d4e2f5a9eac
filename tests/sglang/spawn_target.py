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
    from sglang_bcg_plugin.integration import flag_resolution

    def resolve_share_output(explicit: None, server_args: Any = None) -> bool:
        return resolve_output_mode(flag_resolution(server_args)) != "off"

    load_plugins()
    env = os.environ.get("SGLANG_ENABLE_BCG_SHARED_OUTPUT")
    result = {
        # private: SGLang's HookRegistry has no public read of what it patched
        "plugins_patched": "sglang.srt.server_args.ServerArgs.from_cli_args" in HookRegistry._patched,
        "env": env,
        "stash": getattr(server_args, "_bcg_shared_output", None),
        "from_server_args": resolve_share_output(None, server_args=server_args),
        "from_env": resolve_share_output(None),
    }
    os.environ.pop("SGLANG_ENABLE_BCG_SHARED_OUTPUT", None)
    result["from_server_args_without_env"] = resolve_share_output(None, server_args=server_args)
    queue.put(result)
