"""The plugin manager (built lazily, cached, never at import time) and the observers' calls."""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import os
import threading
import traceback
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

import pluggy

from . import hookspecs
from ._constants import ENV_BLOCK_PLUGINS, NAME
from .errors import ObserverError, ObserverWarning, PluginLoadWarning, warn_user

hookimpl = pluggy.HookimplMarker(NAME)

#: Modules registered as built-in plugins, in this order.
BUILTIN_PLUGINS = ("sglang_bcg_plugin.backends.full", "sglang_bcg_plugin.backends.breakable",
                   "sglang_bcg_plugin.backends.piecewise")

_lock = threading.Lock()
_manager: pluggy.PluginManager | None = None


@dataclass(frozen=True)
class BrokenPlugin:
    """An entry point of group ``sglang_bcg`` that failed to load (import or registration)."""

    entry_point: str
    value: str
    distribution: str
    version: str
    error: str

    def describe(self) -> str:
        return (f"plugin {self.entry_point!r} = {self.value} (distribution {self.distribution} {self.version}) "
                f"failed to load: {self.error}")


class _Manager(pluggy.PluginManager):
    """pluggy's manager plus the record of the entry points that loaded and that failed to load."""

    def __init__(self, project_name: str) -> None:
        super().__init__(project_name)
        self.broken_plugins: list[BrokenPlugin] = []
        self._distributions: list[tuple[object, importlib.metadata.Distribution]] = []

    def list_plugin_distributions(self) -> list[tuple[object, importlib.metadata.Distribution]]:
        """``(plugin, distribution)`` of every entry-point plugin loaded (pluggy's older name:
        ``list_plugin_distinfo``)."""
        return list(self._distributions)

    list_plugin_distinfo = list_plugin_distributions  # type: ignore[assignment]


def _one_line(exc: BaseException) -> str:
    """``Type: message`` on one line (pluggy's validation errors span several)."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def running_hookimpl(impls: Sequence[Any], frames: Iterable[FrameType]) -> int | None:
    """The index in ``impls`` of the hookimpl running in the first of ``frames`` (innermost first)
    that runs one; plugins of one class are told apart by the frame's ``self``."""
    for frame in frames:
        code = frame.f_code
        matches = [i for i, impl in enumerate(impls) if getattr(impl.function, "__code__", None) is code]
        if len(matches) > 1 and code.co_varnames:
            first = frame.f_locals.get(code.co_varnames[0])
            matches = [i for i in matches if getattr(impls[i].function, "__self__", None) is first] or matches
        if matches:
            return matches[0]
    return None


def _check_known_hooks(pm: pluggy.PluginManager, name: str) -> None:
    """:raises pluggy.PluginValidationError: plugin ``name`` implements a hook no hookspec declares."""
    plugin = pm.get_plugin(name)
    for caller in pm.get_hookcallers(plugin) or ():
        if caller.has_spec() or all(impl.optionalhook for impl in caller.get_hookimpls() if impl.plugin is plugin):
            continue
        known = sorted(n for n in dir(hookspecs) if n.startswith(f"{NAME}_"))
        close = difflib.get_close_matches(caller.name, known, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        msg = f"unknown hook {caller.name!r} in plugin {name!r}: {hint}known hooks: {', '.join(known)}"
        raise pluggy.PluginValidationError(plugin, msg)


def _load_entry_points(pm: _Manager) -> None:
    """Load each entry point of group ``sglang_bcg`` in one pass over the distributions; one that
    fails (or implements an unknown hook) is unregistered, recorded and warned about."""
    failed: set[str] = set()
    for dist in importlib.metadata.distributions():
        for ep in dist.entry_points:
            if ep.group != NAME or ep.name in failed or pm.has_plugin(ep.name) or pm.is_blocked(ep.name):
                continue
            try:
                plugin = ep.load()
                pm.register(plugin, name=ep.name)
                _check_known_hooks(pm, ep.name)
            except Exception as exc:  # noqa: BLE001 - any failure of a third-party plugin is reported
                if pm.has_plugin(ep.name):
                    pm.unregister(name=ep.name)
                failed.add(ep.name)
                broken = BrokenPlugin(ep.name, ep.value, dist.metadata["Name"] or "?", dist.version, _one_line(exc))
                pm.broken_plugins.append(broken)
                warn_user(
                    f"{broken.describe()}; its backends are unavailable, the others work "
                    f"(fix or uninstall {broken.distribution}, or set {ENV_BLOCK_PLUGINS}={ep.name})",
                    PluginLoadWarning,
                )
            else:
                pm._distributions.append((plugin, dist))


def _build() -> pluggy.PluginManager:
    pm = _Manager(NAME)
    pm.add_hookspecs(hookspecs)
    for name in filter(None, map(str.strip, os.environ.get(ENV_BLOCK_PLUGINS, "").split(","))):
        pm.set_blocked(name)  # first: a blocked entry point never loads
    _load_entry_points(pm)
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


def broken_plugins(pm: pluggy.PluginManager | None = None) -> tuple[BrokenPlugin, ...]:
    """The ``sglang_bcg`` entry points that failed to load into ``pm`` (default: the process's)."""
    pm = pm or get_plugin_manager()
    return tuple(getattr(pm, "broken_plugins", ()))


def _raising_plugin(caller: Any, exc: BaseException) -> tuple[int | None, str]:
    """The index among ``caller``'s hookimpls of the one that raised ``exc``, and its plugin name."""
    impls = caller.get_hookimpls()
    i = running_hookimpl(impls, reversed([frame for frame, _ in traceback.walk_tb(exc.__traceback__)]))
    return i, "<unknown>" if i is None else impls[i].plugin_name


def observe_started(pm: pluggy.PluginManager, backend: object, key: Hashable) -> None:
    """:raises ObserverError: an observer raised (its error is the cause); nothing was captured."""
    caller = pm.hook.sglang_bcg_capture_started
    try:
        caller(backend=backend, shape_key=key)
    except Exception as exc:
        _, plugin = _raising_plugin(caller, exc)
        msg = (f"capture_one({key!r}) aborted before it began: observer plugin {plugin!r} raised in "
               f"{caller.name}: {_one_line(exc)}; nothing was captured: fix or unregister the plugin, then "
               "capture the key again")
        raise ObserverError(msg, plugin=plugin, hook=caller.name, shape_key=key) from exc


def observe_finished(pm: pluggy.PluginManager, key: Hashable, **kwargs: Any) -> None:
    """Tell every observer a capture ended; one that raises is isolated (an ``ObserverWarning``)."""
    outcome = "the capture stands and the key replays" if kwargs["error"] is None else "the capture's own error propagates"
    caller: Any = pm.hook.sglang_bcg_capture_finished
    told: list[object] = []
    while True:
        try:
            caller(shape_key=key, **kwargs)
            return
        except Exception as exc:
            i, plugin = _raising_plugin(caller, exc)
            msg = (f"observer plugin {plugin!r} raised in {caller.name} for {key!r}: {_one_line(exc)}; the error "
                   f"is isolated: {outcome}")
            warn_user(msg, ObserverWarning)
            if i is None:  # which observers ran is unknown: tell none twice
                return
            # pluggy calls the list last-first: the culprit and every one after it have run
            told.extend(impl.plugin for impl in caller.get_hookimpls()[i:])
            caller = pm.subset_hook_caller(caller.name, remove_plugins=told)
