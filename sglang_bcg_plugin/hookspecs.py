"""Hook specifications of the ``sglang_bcg`` project.

Every hook is prefixed ``sglang_bcg_``; ``docs/hooks.md`` documents each under a heading that
is its exact signature (a test keeps the two in step).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

from ._constants import NAME

if TYPE_CHECKING:
    from .backends.base import CaptureBackend
    from .registry import BackendRegistry
    from .report import KeyReport

hookspec = pluggy.HookspecMarker(NAME)


@hookspec
def sglang_bcg_register_backends(registry: BackendRegistry) -> None:
    """Add backend classes to ``registry``.

    Built-in backends register through this very hook, one hookimpl at the end of each
    backend module. Called once (every plugin, in pluggy's order) when a registry is built; a
    duplicate name is reported with both plugins' names.

    :param registry: call ``registry.add(name, factory)``; ``factory(options=..., **kwargs)``
        must return a :class:`~sglang_bcg_plugin.backends.base.CaptureBackend`.
    """


@hookspec
def sglang_bcg_capture_started(backend: CaptureBackend, shape_key: object) -> None:
    """Observe: a capture of ``shape_key`` begins (checks passed, warmups not yet run).

    Called for every capture of every backend; the capture itself is the backend's and runs
    with every plugin blocked.

    An observer that raises here refuses the capture: it is aborted before it began (nothing of
    the key is kept) and ``capture_one`` raises
    :class:`~sglang_bcg_plugin.errors.ObserverError` naming the plugin (the observer's error is
    its ``__cause__``).

    :param backend: the backend capturing.
    :param shape_key: the key being captured.
    """


@hookspec
def sglang_bcg_capture_finished(
    backend: CaptureBackend, shape_key: object, report: KeyReport | None, error: BaseException | None
) -> None:
    """Observe: a capture of ``shape_key`` ended.

    On success ``report`` is the key's :class:`~sglang_bcg_plugin.report.KeyReport` (capture
    seconds, graph memory growth on CUDA, output bytes, sharing, fallback) and ``error`` is
    ``None``; on failure ``report`` is ``None`` and ``error`` the exception, which propagates to
    the caller after the observers ran (nothing of the key was kept).

    Observers cannot undo what happened: an observer that raises here is isolated (one
    :class:`~sglang_bcg_plugin.errors.ObserverWarning` at the caller's line names the plugin,
    the hook and the error; the other observers are still told) and the capture stands (or, after
    a failure, its own error propagates).

    :param backend: the backend that captured.
    :param shape_key: the key.
    :param report: the key's report, or ``None`` on failure.
    :param error: the exception, or ``None`` on success.
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
