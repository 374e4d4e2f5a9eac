"""Exceptions and warnings raised by the plugin, and warnings attributed to the caller's line."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings

import pluggy
import torch

#: The longest one-line error text the package prints of another's exception.
ONE_LINE_CHARS = 500


def one_line(text: object) -> str:
    """``text`` (an exception, a message) as one line of at most :data:`ONE_LINE_CHARS` characters."""
    return " ".join(str(text).split())[:ONE_LINE_CHARS]


class OutputStructureError(ValueError):
    """A captured output does not fit its partition's shared buffer (strict mode); carries
    ``shape_key``, ``path`` and ``reason``."""

    def __init__(self, shape_key: object, path: str, reason: str) -> None:
        self.shape_key, self.path, self.reason = shape_key, path, reason
        msg = (f"output of {shape_key!r} cannot share its partition's buffer at leaf {path}: "
               f"{reason}; capture largest-first with a stable output structure, or set "
               "strict_outputs=False to let this key keep its own output")
        super().__init__(msg)


class BackendRegistrationError(ValueError):
    """A backend registration is invalid: duplicate name, bad factory or unknown name."""


class CaptureStateError(RuntimeError):
    """A backend method was called in the wrong lifecycle state."""


class PluginLoadWarning(UserWarning):
    """An installed ``sglang_bcg`` plugin failed to load (see :func:`sglang_bcg_plugin.broken_plugins`)."""


class ObserverWarning(UserWarning):
    """A ``sglang_bcg_capture_finished`` observer raised; the error is isolated."""


class ObserverError(RuntimeError):
    """A ``sglang_bcg_capture_started`` observer raised; the capture was aborted before it began.
    Carries ``plugin``, ``hook`` and ``shape_key``; the observer's exception is ``__cause__``."""

    def __init__(self, message: str, *, plugin: str, hook: str, shape_key: object) -> None:
        super().__init__(message)
        self.plugin, self.hook, self.shape_key = plugin, hook, shape_key


#: Frames a warning skips to reach the caller's line.
_INTERNAL = (os.path.dirname(os.path.abspath(__file__)) + os.sep,
             os.path.dirname(os.path.abspath(pluggy.__file__)) + os.sep, os.path.abspath(contextlib.__file__))


def user_stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside this package, pluggy and ``contextlib``."""
    frame = sys._getframe(1)
    level = 1
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(_INTERNAL):
        frame = frame.f_back
        level += 1
    return level


def warn_user(message: str, category: type[Warning]) -> None:
    """``warnings.warn`` attributed to the user's line, not to this package's internals (Python
    3.12+: ``skip_file_prefixes``; before: :func:`user_stacklevel`, the one frame walk of the package)."""
    if sys.version_info >= (3, 12):
        warnings.warn(message, category, skip_file_prefixes=_INTERNAL)  # type: ignore[call-overload,unused-ignore]
    else:
        warnings.warn(message, category, stacklevel=user_stacklevel())


class GraphBreakError(TypeError, ValueError):
    """``graph_break`` cannot make a break point of what it was given: ``reads``/``writes`` that are not
    parameter names, names it cannot match (a builtin without a signature), or not a function. A
    ``TypeError`` and a ``ValueError`` both, as ``inspect`` and argument checks raise either."""


class SplittingOpError(TypeError, ValueError):
    """``splitting_ops`` of the Piecewise backend holds something no graph can split at: not a list,
    not a torch op, an op packet without overloads. A ``TypeError`` and a ``ValueError`` both."""


class ForecastError(RuntimeError):
    """A graph-memory forecast cannot be made."""


_TRANSFORMERS_HINT = ("; transformers' mask preparation (masking_utils.py) reads a 2D attention_mask's values or, "
                      "without one, the position ids (packed sequences) on the host unless a CUDA stream capture is "
                      "running, which the eager engine's is not: pass a prepared 4D boolean mask, or register the "
                      "attention under a name of your own through transformers' AttentionInterface (transformers "
                      "builds no mask for it; for Breakable a @graph_break function) "
                      "(docs/breakable.md#transformers-attention)")


class HostReadError(RuntimeError):
    """A capture read a tensor's value on the host inside a graph segment (docs/refusals.md); carries
    ``shape_key``, ``segment`` (``None``: a Full graph), ``op`` and ``where`` (the user's frame or ``None``)."""

    def __init__(self, shape_key: object, segment: int | None, op: str, where: str | None = None) -> None:
        self.shape_key, self.segment, self.op, self.where = shape_key, segment, op, where
        inside = "its graph" if segment is None else f"segment {segment}"
        at = f", at {where}" if where else ""
        hint = _TRANSFORMERS_HINT if where is not None and f"{os.sep}transformers{os.sep}" in where else ""
        msg = (f"capture of {shape_key!r} read a tensor's value on the host inside {inside} ({op}{at}): a CUDA graph "
               "records device work only, so every replay would reuse the value read at capture (on CUDA such a "
               "capture fails: a host sync inside a stream capture). Keep the value on the device (torch.where or a "
               "mask instead of `if`, no .item()/.tolist()), or move the read into a @graph_break function (it runs "
               f"eagerly at every replay); reads during the warmups and outside capture are fine{hint}")
        super().__init__(msg)


def user_frame(frames: list[tuple[str, int, str]]) -> str | None:
    """``file:line in function`` of the innermost of ``frames`` (outermost first) outside torch, this
    package, pluggy and ``contextlib``, else ``None``."""
    skipped = (*_INTERNAL, os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)
    for filename, lineno, function in reversed(frames):
        if not os.path.abspath(filename).startswith(skipped):
            return f"{filename}:{lineno} in {function}"
    return None
