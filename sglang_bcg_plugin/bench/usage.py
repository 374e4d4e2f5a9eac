"""``UsageError``: a command-line input of ``sglang-bcg`` is invalid (the CLI's error type), and
``shown``, a user's value in its messages."""

from __future__ import annotations

#: Characters of a user's value echoed in a message before it is cut.
SHOWN_CHARS = 80


class UsageError(ValueError):
    """A command-line input is invalid; ``sglang-bcg`` prints it as one ``error:`` line."""


def shown(value: object, *, quote: bool | None = None) -> str:
    """A user's value for a message, cut to ``SHOWN_CHARS`` characters with ``…`` and the full
    length; ``quote``: ``repr`` it (default: strings only)."""
    text = str(value)
    show = repr if (isinstance(value, str) if quote is None else quote) else str
    if len(text) <= SHOWN_CHARS:
        return show(text)
    return f"{show(text[:SHOWN_CHARS])}… ({len(text)} characters)"
