"""``UsageError``: a command-line input of ``sglang-bcg`` is invalid (the CLI's error type), and
``shown``, a user's value in its messages."""

from __future__ import annotations

from .. import _words


class UsageError(ValueError):
    """A command-line input is invalid; ``sglang-bcg`` prints it as one ``error:`` line."""


def shown(value: object, *, quote: bool | None = None) -> str:
    """A user's value for a message, cut as :func:`.._words.shown` cuts it; ``quote``: ``repr`` it
    (default: strings only)."""
    text, cut = str(value), _words.SHOWN_CHARS
    if isinstance(value, str) if quote is None else quote:
        return _words.shown(text)
    return text if len(text) <= cut else f"{text[:cut]}… ({len(text)} characters)"
