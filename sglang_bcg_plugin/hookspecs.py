"""Hook specifications of the ``sglang_bcg`` project; ``docs/hooks.md`` documents each hook."""

from __future__ import annotations

import pluggy

from ._constants import NAME
from .contract import BackendProtocol, RegistryProtocol
from .output.report import KeyReport

hookspec = pluggy.HookspecMarker(NAME)


@hookspec
def sglang_bcg_register_backends(registry: RegistryProtocol) -> None:
    """Add backend classes to ``registry``; called once per registry build.

    :param registry: call ``registry.add(name, factory)``; ``factory(options=..., **kwargs)``
        must return a :class:`~sglang_bcg_plugin.backends.base.CaptureBackend`."""


@hookspec
def sglang_bcg_capture_started(backend: BackendProtocol, shape_key: object) -> None:
    """Observe: a capture of ``shape_key`` begins (checks passed, before the warmups). Raising aborts
    the capture: ``capture_one`` raises :class:`~sglang_bcg_plugin.errors.ObserverError`.

    :param backend: the backend capturing.
    :param shape_key: the key being captured."""


@hookspec
def sglang_bcg_capture_finished(backend: BackendProtocol, shape_key: object, report: KeyReport | None,
                                error: BaseException | None) -> None:
    """Observe: a capture of ``shape_key`` ended. Raising is isolated (an ``ObserverWarning``).

    :param report: the key's :class:`~sglang_bcg_plugin.output.report.KeyReport`, or ``None`` on failure.
    :param error: the capture's exception (it propagates after the observers), or ``None``."""


@hookspec(firstresult=True)
def sglang_bcg_select_backend(phase: str, server_args: object) -> str | None:
    """Choose the registered backend SGLang uses for ``phase`` (first non-None result wins).

    :param phase: ``"prefill"`` or ``"decode"``.
    :param server_args: SGLang's ``ServerArgs`` of this process (may be ``None``).
    :returns: a registered backend name, or ``None`` (or ``"sglang-breakable"``) to keep the default, SGLang's
        breakable backend under the plugin's output policy; ``"breakable"`` keeps it too, deprecated (a
        ``DeprecationWarning``): it names the plugin's own ``BreakableBackend``."""
