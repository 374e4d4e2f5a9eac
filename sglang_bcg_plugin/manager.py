"""The plugin manager (built lazily, cached, never at import time), the per-plugin hook calls (:func:`call_each`: each
implementation on its own, so one plugin's error never stops the others) and the observers' calls."""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import importlib
import importlib.metadata
import os
import threading
from collections.abc import Generator, Hashable, Iterator, Mapping
from dataclasses import dataclass
from types import ModuleType
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
#: The plugin whose hookimpl :func:`call_each` is running in this context.
_running: contextvars.ContextVar[str | None] = contextvars.ContextVar("sglang_bcg_running_plugin", default=None)


@dataclass(frozen=True)
class BrokenPlugin:
    """A plugin that failed: an entry point of group ``sglang_bcg`` that failed to load (import or validation; ``hook``
    is ``None``), or a registered plugin whose ``hook`` raised.

    ``entry_point`` is the plugin's name (its entry point's, or the name it was registered under), ``value`` what it
    loads (the entry point's value, or the plugin's module or class), ``distribution`` and ``version`` where it is
    installed from (``""`` for a plugin registered in the process), ``error`` the exception on one line."""

    entry_point: str
    value: str
    distribution: str
    version: str
    error: str
    hook: str | None = None

    def describe(self) -> str:
        source = f"= {self.value} (distribution {self.distribution} {self.version})" if self.distribution \
            else f"({self.value})"
        failed = "failed to load" if self.hook is None else f"raised in {self.hook}"
        return f"plugin {self.entry_point!r} {source} {failed}: {self.error}"

    def remedy(self) -> str:
        """What to do: fix or uninstall it, or block it."""
        fix = f"fix or uninstall {self.distribution}" if self.distribution else "fix or unregister it"
        return f"{fix}, or set {ENV_BLOCK_PLUGINS}={self.entry_point}"


@dataclass(frozen=True)
class HookFailure:
    """One hook implementation that raised: its ``plugin``'s name, the ``hook`` and the ``error``."""

    plugin: str
    hook: str
    error: Exception

    def error_line(self) -> str:
        return _one_line(self.error)


class _Manager(pluggy.PluginManager):
    """pluggy's manager plus the record of the entry points that loaded and that failed to load."""

    def __init__(self, project_name: str) -> None:
        super().__init__(project_name)
        self.broken_plugins: list[BrokenPlugin] = []
        self._distributions: list[tuple[object, importlib.metadata.Distribution]] = []
        #: plugin name -> ``(entry point value, distribution, version)`` of each entry point loaded
        self.origins: dict[str, tuple[str, str, str]] = {}

    def list_plugin_distributions(self) -> list[tuple[object, importlib.metadata.Distribution]]:
        """``(plugin, distribution)`` of every entry-point plugin loaded (older name: ``list_plugin_distinfo``)."""
        return list(self._distributions)

    list_plugin_distinfo = list_plugin_distributions  # type: ignore[assignment]


def warn_broken(broken: BrokenPlugin) -> None:
    """One ``PluginLoadWarning``: ``broken``'s backends are unavailable, the others work."""
    warn_user(f"{broken.describe()}; its backends are unavailable, the others work ({broken.remedy()})",
              PluginLoadWarning)


def _one_line(exc: BaseException) -> str:
    """``Type: message`` on one line (pluggy's validation errors span several)."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def plugin_origin(pm: pluggy.PluginManager, name: str) -> tuple[str, str, str]:
    """``(value, distribution, version)`` of the plugin registered as ``name``: its entry point's value
    and distribution, else its module (or class) and ``""``."""
    origins: dict[str, tuple[str, str, str]] = getattr(pm, "origins", {})
    if name in origins:
        return origins[name]
    plugin = pm.get_plugin(name)
    if plugin is None or isinstance(plugin, ModuleType):
        return getattr(plugin, "__name__", name), "", ""
    cls = plugin if isinstance(plugin, type) else type(plugin)
    return f"{cls.__module__}:{cls.__qualname__}", "", ""


def running_plugin() -> str | None:
    """The name of the plugin whose hookimpl :func:`call_each` is running now, else ``None``."""
    return _running.get()


@contextlib.contextmanager
def _running_as(impl: pluggy.HookImpl) -> Iterator[None]:
    token = _running.set(impl.plugin_name)
    try:
        yield
    finally:
        _running.reset(token)


def _invoke(impl: pluggy.HookImpl, kwargs: Mapping[str, object]) -> Any:
    """``impl``'s function with the hook's arguments it names (positional by ``argnames``, the
    defaulted ones it also names by keyword), as pluggy passes them; a wrapper (``wrapper=True`` or
    the old ``hookwrapper=True``, a generator function) run up to its ``yield``."""
    extra = {name: kwargs[name] for name in impl.kwargnames if name in kwargs}
    with _running_as(impl):
        result: Any = impl.function(*(kwargs[name] for name in impl.argnames), **extra)
        if impl.wrapper or impl.hookwrapper:
            try:
                next(result)
            except StopIteration:
                msg = f"wrapper {impl.function.__qualname__} of plugin {impl.plugin_name!r} did not yield"
                raise RuntimeError(msg) from None
        return result


def call_each(caller: pluggy.HookCaller, kwargs: Mapping[str, object], *,
              stop_at_first: bool = False) -> list[HookFailure]:
    """Call every implementation of ``caller`` with ``kwargs`` on its own, in pluggy's order (last
    registered first, ``tryfirst``/``trylast`` honoured, wrappers around the others and resumed with
    their results); an ``Exception`` of one is caught and returned with its plugin, and every other
    implementation still runs (``stop_at_first``: the ones after it are skipped; the wrappers opened
    still close). ``KeyboardInterrupt`` and other ``BaseException``s propagate."""
    failures: list[HookFailure] = []
    opened: list[tuple[pluggy.HookImpl, Generator[None, object, object]]] = []
    results: list[object] = []
    try:
        for impl in reversed(caller.get_hookimpls()):
            if failures and stop_at_first:
                break
            try:
                result = _invoke(impl, kwargs)
                if impl.wrapper or impl.hookwrapper:
                    opened.append((impl, result))
                elif result is not None:
                    results.append(result)
            except Exception as exc:  # noqa: BLE001 - one plugin's error, isolated and returned
                failures.append(HookFailure(impl.plugin_name, caller.name, exc))
    except BaseException:
        for _, gen in opened:
            gen.close()
        raise
    for impl, gen in reversed(opened):  # resumed with the results (a ``pluggy.Result`` for an old-style one)
        try:
            with _running_as(impl):
                try:
                    gen.send(pluggy.Result(results, None) if impl.hookwrapper else results)
                except StopIteration:
                    continue
                finally:
                    gen.close()
            msg = f"wrapper {impl.function.__qualname__} of plugin {impl.plugin_name!r} has a second yield"
            raise RuntimeError(msg)
        except Exception as exc:  # noqa: BLE001 - as above
            failures.append(HookFailure(impl.plugin_name, caller.name, exc))
    return failures


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
            origin = (ep.value, dist.metadata["Name"] or "?", dist.version)
            try:
                plugin = ep.load()
                pm.register(plugin, name=ep.name)
                _check_known_hooks(pm, ep.name)
            except Exception as exc:  # noqa: BLE001 - any failure of a third-party plugin is reported
                if pm.has_plugin(ep.name):
                    pm.unregister(name=ep.name)
                failed.add(ep.name)
                pm.broken_plugins.append(broken := BrokenPlugin(ep.name, *origin, _one_line(exc)))
                warn_broken(broken)
            else:
                pm._distributions.append((plugin, dist))
                pm.origins[ep.name] = origin


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager (entry points of group ``sglang_bcg`` + built-ins)."""
    global _manager
    with _lock:
        if _manager is None:
            pm = _Manager(NAME)
            pm.add_hookspecs(hookspecs)
            for name in filter(None, map(str.strip, os.environ.get(ENV_BLOCK_PLUGINS, "").split(","))):
                pm.set_blocked(name)  # first: a blocked entry point never loads
            _load_entry_points(pm)
            for module_name in BUILTIN_PLUGINS:
                if not pm.is_blocked(module_name):
                    pm.register(importlib.import_module(module_name), name=module_name)
            pm.check_pending()
            _manager = pm
        return _manager


def reset_plugin_manager() -> None:
    """Forget the cached manager; the next ``get_plugin_manager()`` rebuilds it (tests)."""
    global _manager
    with _lock:
        _manager = None


def load_failures(pm: pluggy.PluginManager) -> tuple[BrokenPlugin, ...]:
    """The ``sglang_bcg`` entry points that failed to load into ``pm`` (none for a manager this
    module did not build); :func:`sglang_bcg_plugin.broken_plugins` adds the registration failures."""
    return tuple(getattr(pm, "broken_plugins", ()))


def observe_started(pm: pluggy.PluginManager, backend: object, key: Hashable) -> None:
    """Tell the observers a capture begins, each on its own; the first that raises stops the others.

    :raises ObserverError: an observer raised (its error is the cause); nothing was captured."""
    caller = pm.hook.sglang_bcg_capture_started
    failures = call_each(caller, {"backend": backend, "shape_key": key}, stop_at_first=True)
    if failures:
        failure = failures[0]
        msg = (f"capture_one({key!r}) aborted before it began: observer plugin {failure.plugin!r} raised in "
               f"{caller.name}: {failure.error_line()}; nothing was captured: fix or unregister the plugin, then "
               "capture the key again")
        raise ObserverError(msg, plugin=failure.plugin, hook=caller.name, shape_key=key) from failure.error


def observe_finished(pm: pluggy.PluginManager, key: Hashable, **kwargs: Any) -> None:
    """Tell every observer a capture ended, each on its own; one that raises is isolated (an
    ``ObserverWarning`` per observer that raised) and every other one is still told."""
    outcome = ("the capture stands and the key replays" if kwargs["error"] is None
               else "the capture's own error propagates")
    for failure in call_each(pm.hook.sglang_bcg_capture_finished, {"shape_key": key, **kwargs}):
        msg = (f"observer plugin {failure.plugin!r} raised in {failure.hook} for {key!r}: {failure.error_line()}; "
               f"the error is isolated: {outcome}")
        warn_user(msg, ObserverWarning)
