"""Exceptions raised by the plugin."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings

import pluggy


class OutputStructureError(ValueError):
    """A captured output does not fit its partition's shared buffer (strict mode).

    Carries the facts a warning would print: the shape key, the leaf path and the reason.
    """

    def __init__(self, shape_key: object, path: str, reason: str) -> None:
        self.shape_key = shape_key
        self.path = path
        self.reason = reason
        msg = (
            f"output of {shape_key!r} cannot share its partition's buffer at leaf {path}: "
            f"{reason}; capture largest-first with a stable output structure, or set "
            "strict_outputs=False to let this key keep its own output"
        )
        super().__init__(msg)


class BackendRegistrationError(ValueError):
    """A backend registration is invalid: duplicate name, bad factory or unknown name."""


class CaptureStateError(RuntimeError):
    """A backend method was called in the wrong lifecycle state."""


class PluginLoadWarning(UserWarning):
    """An installed ``sglang_bcg`` plugin failed to load; the other backends still work.

    The message names the entry point, its distribution and the error; the same facts are in
    :func:`sglang_bcg_plugin.broken_plugins`.
    """


class ObserverWarning(UserWarning):
    """An observer hook (``sglang_bcg_capture_finished``) raised after a capture ended: the error is
    isolated, the capture stands (or its own error propagates) and every other observer was told.
    The message names the plugin, the hook, the key and the error."""


class ObserverError(RuntimeError):
    """An observer raised in ``sglang_bcg_capture_started``: the capture was aborted before it began
    (nothing of the key is kept). Carries ``plugin``, ``hook`` and ``shape_key``; the observer's
    exception is ``__cause__``."""

    def __init__(self, message: str, *, plugin: str, hook: str, shape_key: object) -> None:
        super().__init__(message)
        self.plugin = plugin
        self.hook = hook
        self.shape_key = shape_key


#: Frames a warning skips to reach the caller's line: this package, pluggy (hook calls) and
#: ``contextlib`` (``with backend.capture_session():``).
_INTERNAL = (
    os.path.dirname(os.path.abspath(__file__)) + os.sep,
    os.path.dirname(os.path.abspath(pluggy.__file__)) + os.sep,
    os.path.abspath(contextlib.__file__),
)


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a ``warnings.warn`` called by this function's caller point at
    the first frame outside this package, pluggy and ``contextlib`` (the user's call)."""
    frame = sys._getframe(1)
    level = 1
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(_INTERNAL):
        frame = frame.f_back
        level += 1
    return level


def warn_user(message: str, category: type[Warning]) -> None:
    """``warnings.warn`` attributed to the user's line, not to this package's internals."""
    warnings.warn(message, category, stacklevel=user_stacklevel())


class ForecastError(RuntimeError):
    """A graph-memory forecast cannot be made (the forward's memory does not scale as one
    pattern, or the engine has no graph pool to forecast)."""
