"""``UsageError``: a command-line input of ``sglang-bcg`` is invalid (the CLI's error type)."""

from __future__ import annotations


class UsageError(ValueError):
    """A command-line input is invalid; ``sglang-bcg`` prints it as one ``error:`` line."""
