"""Hook specifications of the ``sglang_bcg`` project; ``docs/hooks.md`` documents each hook."""

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
    """Add backends with ``registry.add(name, factory)`` (``factory(options=..., **kwargs)`` returns a
    :class:`~sglang_bcg_plugin.backends.base.CaptureBackend`); called once per registry build."""


@hookspec
def sglang_bcg_capture_started(backend: CaptureBackend, shape_key: object) -> None:
    """Observe: ``backend`` begins a capture of ``shape_key`` (checks passed, before the warmups).
    Raising aborts the capture: ``capture_one`` raises :class:`~sglang_bcg_plugin.errors.ObserverError`."""


@hookspec
def sglang_bcg_capture_finished(
    backend: CaptureBackend, shape_key: object, report: KeyReport | None, error: BaseException | None
) -> None:
    """Observe: a capture of ``shape_key`` ended with ``report`` (its :class:`~sglang_bcg_plugin.report.KeyReport`)
    or ``error`` (which propagates after the observers). Raising is isolated (an ``ObserverWarning``)."""


@hookspec(firstresult=True)
def sglang_bcg_select_backend(phase: str, server_args: object) -> str | None:
    """The registered backend SGLang uses for ``phase`` (``"prefill"`` or ``"decode"``) given this
    process's ``ServerArgs`` (or ``None``); ``None`` keeps the default; the first non-None wins."""
