"""Exceptions raised by the plugin."""

from __future__ import annotations


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


class UsageError(ValueError):
    """A command-line input is invalid; ``sglang-bcg`` prints it as one ``error:`` line."""
