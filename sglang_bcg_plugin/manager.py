"""The plugin manager: built lazily, cached, never at import time."""

from __future__ import annotations

import importlib
import os
import threading

import pluggy

from . import hookspecs
from ._constants import ENV_BLOCK_PLUGINS, NAME

hookimpl = pluggy.HookimplMarker(NAME)

#: Modules registered as built-in plugins, in this order.
BUILTIN_PLUGINS = (
    "sglang_bcg_plugin.backends.full",
    "sglang_bcg_plugin.backends.breakable",
    "sglang_bcg_plugin.backends.piecewise",
    "sglang_bcg_plugin.accounting",
    "sglang_bcg_plugin.backends.base",
)

_lock = threading.Lock()
_manager: pluggy.PluginManager | None = None


def _build() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(NAME)
    pm.add_hookspecs(hookspecs)
    # Blocked names first so a listed entry point never loads (tox's order).
    for name in os.environ.get(ENV_BLOCK_PLUGINS, "").split(","):
        if name.strip():
            pm.set_blocked(name.strip())
    pm.load_setuptools_entrypoints(NAME)
    for module_name in BUILTIN_PLUGINS:
        if not pm.is_blocked(module_name):
            pm.register(importlib.import_module(module_name), name=module_name)
    pm.check_pending()
    return pm


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager (entry points of group ``sglang_bcg`` + built-ins)."""
    global _manager
    with _lock:
        if _manager is None:
            _manager = _build()
        return _manager


def reset_plugin_manager() -> None:
    """Forget the cached manager; the next ``get_plugin_manager()`` rebuilds it (tests)."""
    global _manager
    with _lock:
        _manager = None
