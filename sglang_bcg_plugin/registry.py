"""The backend registry, filled by the ``sglang_bcg_register_backends`` hook, one plugin at a time:
a plugin whose hookimpl raises is broken, its backends are dropped, and every other plugin's stay."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

from .errors import BackendRegistrationError
from .manager import (BrokenPlugin, call_each, get_plugin_manager, load_failures, plugin_origin, running_plugin,
                      warn_broken)
from .options import BackendOptions

if TYPE_CHECKING:
    from .backends.base import CaptureBackend

BackendFactory = Callable[..., "CaptureBackend"]
#: Plugin name given to an ``add`` made outside any hookimpl.
DIRECT = "<direct>"
#: Per plugin manager, the registration failures already warned about: ``(plugin, error)``.
_warned: weakref.WeakKeyDictionary[pluggy.PluginManager, set[tuple[str, str]]] = weakref.WeakKeyDictionary()


def _describe(factory: object) -> str:
    return f"{getattr(factory, '__module__', '?')}:{getattr(factory, '__qualname__', type(factory).__qualname__)}"


class BackendRegistry:
    """Backend name -> factory, with the plugin that registered each name (the plugin whose hookimpl
    is running, :func:`~sglang_bcg_plugin.manager.running_plugin`; an ``add`` from none is
    ``"<direct>"``), and the plugins that are broken (:attr:`broken`)."""

    def __init__(self) -> None:
        self._factories: dict[str, tuple[BackendFactory, str]] = {}
        self._refusals: list[BackendRegistrationError] = []  # raised by add: never isolated (build_registry)
        self._broken: list[BrokenPlugin] = []
        self._dropped: dict[str, BrokenPlugin] = {}  # backend name -> the broken plugin that had added it

    def add(self, name: str, factory: BackendFactory) -> None:
        """Register ``factory`` under ``name``.

        :raises BackendRegistrationError: bad name, non-callable factory, or the name is claimed."""
        plugin = running_plugin() or DIRECT
        if not isinstance(name, str) or not name.isidentifier():
            msg = f"plugin {plugin!r} registers backend name {name!r}: expected an identifier str"
        elif not callable(factory):
            msg = f"plugin {plugin!r} registers backend {name!r} with non-callable {factory!r}"
        elif name in self._factories:
            other, other_plugin = self._factories[name]
            msg = (f"backend name {name!r} is claimed by two plugins: {other_plugin!r} ({_describe(other)}) and "
                   f"{plugin!r} ({_describe(factory)}); block one with SGLANG_BCG_BLOCK_PLUGINS")
        else:
            self._factories[name] = (factory, plugin)
            return
        self._refusals.append(refusal := BackendRegistrationError(msg))
        raise refusal

    def names(self) -> list[str]:
        return sorted(self._factories)

    @property
    def broken(self) -> tuple[BrokenPlugin, ...]:
        """The plugins that failed to load, then those whose registration hookimpl raised."""
        return tuple(self._broken)

    def get(self, name: str) -> BackendFactory:
        """The factory registered as ``name``.

        :raises BackendRegistrationError: no such backend; naming the broken plugin that had
            registered it or has its name, else every broken plugin, which may provide it."""
        if name in self._factories:
            return self._factories[name][0]
        # the plugin that had added it, else a broken plugin of that name (a plugin often names its backend)
        culprit = self._dropped.get(name) or next((b for b in self._broken if b.entry_point == name), None)
        if culprit is not None:
            msg = f"backend {name!r} is unavailable: {culprit.describe()}; {culprit.remedy()}"
        else:
            msg = f"unknown backend {name!r}; available: {', '.join(self.names()) or '(none)'}"
            if self._broken:
                msg += ("; broken plugins, which may provide it: "
                        + "; ".join(f"{b.describe()} ({b.remedy()})" for b in self._broken))
        raise BackendRegistrationError(msg)

    def plugin_of(self, name: str) -> str:
        return self._factories[name][1]


def _collect(pm: pluggy.PluginManager) -> BackendRegistry:
    """Every plugin's ``sglang_bcg_register_backends``, called on its own; a refusal of ``add`` that
    left its hookimpl stays in the registry's refusals for :func:`build_registry` to raise."""
    registry = BackendRegistry()
    registry._broken.extend(load_failures(pm))
    warned = _warned.setdefault(pm, set())
    failures = call_each(pm.hook.sglang_bcg_register_backends, {"registry": registry})
    registry._refusals = [r for r in registry._refusals if any(f.error is r for f in failures)]
    for failure in (f for f in failures if f.error not in registry._refusals):
        broken = BrokenPlugin(failure.plugin, *plugin_origin(pm, failure.plugin), failure.error_line(), failure.hook)
        # every backend its plugin added before it raised is dropped
        for name in [n for n, (_, plugin) in registry._factories.items() if plugin == broken.entry_point]:
            del registry._factories[name]
            registry._dropped[name] = broken
        registry._broken.append(broken)
        if (broken.entry_point, broken.error) not in warned:
            warned.add((broken.entry_point, broken.error))
            warn_broken(broken)
    return registry


def build_registry(pm: pluggy.PluginManager | None = None) -> BackendRegistry:
    """Ask every plugin to register its backends, each hookimpl on its own in pluggy's order; one
    that raises is broken (one ``PluginLoadWarning`` per plugin manager, :attr:`BackendRegistry.broken`)
    and every other plugin's backends stay.

    :raises BackendRegistrationError: ``registry.add`` refused a registration (a bad name, a
        non-callable factory, a name claimed twice)."""
    if (registry := _collect(pm or get_plugin_manager()))._refusals:
        raise registry._refusals[0]
    return registry


def broken_plugins(pm: pluggy.PluginManager | None = None) -> tuple[BrokenPlugin, ...]:
    """The plugins of ``pm`` (default: the process's) that are broken: the ``sglang_bcg`` entry
    points that failed to load, then the plugins whose ``sglang_bcg_register_backends`` raises
    (every registration hook is called to find out)."""
    pm = pm or get_plugin_manager()
    if not hasattr(pm.hook, "sglang_bcg_register_backends"):  # a manager without our hookspecs
        return load_failures(pm)
    return _collect(pm).broken


def listing(registry: BackendRegistry) -> list[str]:
    """What ``sglang-bcg backends`` and ``doctor`` print: one ``name<TAB>module`` line per backend
    (the module of its factory, built-in or not), then one ``BROKEN name (source)[ in hook]: error``
    line per broken plugin (``source``: its distribution and version, else its module or class)."""
    return [f"{name}\t{getattr(registry.get(name), '__module__', '?')}" for name in registry.names()] + [
        f"BROKEN {b.entry_point} ({f'{b.distribution} {b.version}' if b.distribution else b.value})"
        f"{'' if b.hook is None else f' in {b.hook}'}: {b.error}" for b in registry.broken]


def available_backends(pm: pluggy.PluginManager | None = None) -> list[str]:
    """Sorted names of every registered backend (built-in and third-party; none of a broken plugin)."""
    return build_registry(pm).names()


def create_backend(name: str, *, options: BackendOptions | None = None,
                   plugin_manager: pluggy.PluginManager | None = None, **kwargs: Any) -> CaptureBackend:
    """Create the backend registered as ``name``.

    :raises BackendRegistrationError: unknown name, or a backend of a broken plugin (the error names
        the plugin and its failure). :raises TypeError: ``options`` is not a ``BackendOptions``."""
    if options is not None and not isinstance(options, BackendOptions):
        raise TypeError(f"create_backend({name!r}): options must be a BackendOptions or None, got "
                        f"{type(options).__name__} {options!r}; write options=BackendOptions(...)")
    pm = plugin_manager or get_plugin_manager()
    factory = build_registry(pm).get(name)
    return factory(options=options, plugin_manager=pm, **kwargs)
