"""The backend registry, filled by the ``sglang_bcg_register_backends`` hook."""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import pluggy

from .errors import BackendRegistrationError
from .manager import get_plugin_manager, running_hookimpl
from .options import BackendOptions

if TYPE_CHECKING:
    from .backends.base import CaptureBackend

BackendFactory = Callable[..., "CaptureBackend"]


def _describe(factory: object) -> str:
    return f"{getattr(factory, '__module__', '?')}:{getattr(factory, '__qualname__', type(factory).__qualname__)}"


class BackendRegistry:
    """Backend name -> factory, with the plugin that registered each name (``impls``: the hookimpls
    about to fill it; an ``add`` from none of them is ``"<direct>"``)."""

    def __init__(self, impls: Sequence[Any] = ()) -> None:
        self._factories: dict[str, tuple[BackendFactory, str]] = {}
        self._impls = list(impls)

    def add(self, name: str, factory: BackendFactory) -> None:
        """Register ``factory`` under ``name``.

        :raises BackendRegistrationError: bad name, non-callable factory, or the name is claimed."""
        # the caller, then outwards: whose hookimpl is it?
        i = running_hookimpl(self._impls, (frame for frame, _ in traceback.walk_stack(sys._getframe(1))))
        plugin = "<direct>" if i is None else self._impls[i].plugin_name
        if not isinstance(name, str) or not name.isidentifier():
            msg = f"plugin {plugin!r} registers backend name {name!r}: expected an identifier str"
            raise BackendRegistrationError(msg)
        if not callable(factory):
            msg = f"plugin {plugin!r} registers backend {name!r} with non-callable {factory!r}"
            raise BackendRegistrationError(msg)
        if name in self._factories:
            other, other_plugin = self._factories[name]
            msg = (f"backend name {name!r} is claimed by two plugins: {other_plugin!r} "
                   f"({_describe(other)}) and {plugin!r} ({_describe(factory)}); "
                   f"block one with SGLANG_BCG_BLOCK_PLUGINS")
            raise BackendRegistrationError(msg)
        self._factories[name] = (factory, plugin)

    def names(self) -> list[str]:
        return sorted(self._factories)

    def get(self, name: str) -> BackendFactory:
        try:
            return self._factories[name][0]
        except KeyError:
            msg = f"unknown backend {name!r}; available: {', '.join(self.names()) or '(none)'}"
            raise BackendRegistrationError(msg) from None

    def plugin_of(self, name: str) -> str:
        return self._factories[name][1]


def build_registry(pm: pluggy.PluginManager | None = None) -> BackendRegistry:
    """Ask every plugin to register its backends: one call of the hook, in pluggy's order."""
    pm = pm or get_plugin_manager()
    caller = pm.hook.sglang_bcg_register_backends
    registry = BackendRegistry(caller.get_hookimpls())
    caller(registry=registry)
    return registry


def available_backends(pm: pluggy.PluginManager | None = None) -> list[str]:
    """Sorted names of every registered backend (built-in and third-party)."""
    return build_registry(pm).names()


def create_backend(name: str, *, options: BackendOptions | None = None,
                   plugin_manager: pluggy.PluginManager | None = None, **kwargs: Any) -> CaptureBackend:
    """Create the backend registered as ``name``.

    :raises BackendRegistrationError: unknown name. :raises TypeError: ``options`` is not a ``BackendOptions``."""
    if options is not None and not isinstance(options, BackendOptions):
        msg = (f"create_backend({name!r}): options must be a BackendOptions or None, got "
               f"{type(options).__name__} {options!r}; write options=BackendOptions(...)")
        raise TypeError(msg)
    pm = plugin_manager or get_plugin_manager()
    factory = build_registry(pm).get(name)
    return factory(options=options, plugin_manager=pm, **kwargs)
