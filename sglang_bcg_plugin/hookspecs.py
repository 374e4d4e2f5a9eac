"""Hook specifications of the ``sglang_bcg`` project.

Every hook is prefixed ``sglang_bcg_``; ``docs/hooks.md`` documents each under a heading that
is its exact signature (a test keeps the two in step).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pluggy

from ._constants import NAME

if TYPE_CHECKING:
    from .backends.base import CaptureBackend
    from .registry import BackendRegistry

hookspec = pluggy.HookspecMarker(NAME)


@hookspec
def sglang_bcg_register_backends(registry: BackendRegistry) -> None:
    """Add backend classes to ``registry``.

    Built-in backends register through this very hook, one hookimpl at the end of each
    backend module. Called once per plugin when a registry is built, so a duplicate name
    can be reported with both plugins' names.

    :param registry: call ``registry.add(name, factory)``; ``factory(options=..., **kwargs)``
        must return a :class:`~sglang_bcg_plugin.backends.base.CaptureBackend`.
    """


@hookspec(firstresult=True)
def sglang_bcg_capture_one(
    backend: CaptureBackend, shape_key: object, capture: Callable[[], object]
) -> object | None:
    """Capture one shape key; wrap it to observe or account for captures.

    The built-in implementation (``trylast``) returns ``capture()``. Wrappers
    (``@hookimpl(wrapper=True)``) see every capture of every backend: the per-key capture time
    and memory accounting is such a wrapper (``sglang_bcg_plugin.accounting``).

    Stops at first non-None result.

    :param backend: the backend capturing.
    :param shape_key: the key being captured.
    :param capture: performs warmups and capture and registers the graph; returns the static
        output. Call it exactly once.
    :returns: the static output of the captured graph.
    """


@hookspec(firstresult=True)
def sglang_bcg_select_backend(phase: str, server_args: object) -> str | None:
    """Choose the registered backend SGLang uses for ``phase``.

    Consulted by the SGLang integration when SGLang's configuration selects the breakable
    backend. Return a name from ``available_backends()`` to route the phase to it.

    Stops at first non-None result.

    :param phase: ``"prefill"`` or ``"decode"``.
    :param server_args: SGLang's ``ServerArgs`` of this process (may be ``None``).
    :returns: a backend name, or ``None`` to keep the default (``"breakable"``).
    """
