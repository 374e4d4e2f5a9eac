"""The one parser of a switch's word (options, environment variables, the server flag): any case,
surrounding whitespace; anything else is an error naming the switch and the accepted values."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TypeVar

T = TypeVar("T")

#: The boolean spellings every boolean switch accepts, and how errors list them.
BOOLEAN: Mapping[str, bool] = {
    "1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False,
}
BOOLEAN_TEXT = "1/0, true/false, yes/no, on/off"
#: A longer value is shown cut, with its length (a 100 KB variable is not echoed whole).
SHOWN_CHARS = 80


def shown(raw: str) -> str:
    """``repr(raw)``, cut to :data:`SHOWN_CHARS` characters with ``…`` and the full length."""
    return repr(raw) if len(raw) <= SHOWN_CHARS else f"{raw[:SHOWN_CHARS]!r}… ({len(raw)} characters)"


def parse_word(raw: object, words: Mapping[str, T], what: str, *, kind: str, accepted: str | None = None) -> T:
    """``words[raw]``, ``raw`` in any case with surrounding whitespace (``words``' keys are lowercase);
    messages name ``what`` (the switch), the value, ``kind`` and ``accepted`` (default: the keys).

    :raises TypeError: ``raw`` is not a str. :raises ValueError: ``raw`` is not one of ``words``."""
    if accepted is None:  # 'a', 'b' or 'c'
        quoted = [f"'{n}'" for n in words]
        accepted = quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
    if not isinstance(raw, str):
        raise TypeError(f"{what} must be {accepted}, got {repr(raw)[:200]} of type {type(raw).__name__}")
    key = raw.strip().lower()
    if key not in words:
        raise ValueError(f"{what}={shown(raw)} is not {kind}; use one of {accepted} (any case)")
    return words[key]


def parse_env(name: str, words: Mapping[str, T], *, kind: str, accepted: str | None = None,
              environ: Mapping[str, str] | None = None) -> T | None:
    """The environment variable ``name`` read by :func:`parse_word`; ``None`` when unset or blank."""
    raw = (os.environ if environ is None else environ).get(name)
    return parse_word(raw, words, name, kind=kind, accepted=accepted) if raw and raw.strip() else None


def parse_bool_env(name: str, environ: Mapping[str, str] | None = None) -> bool | None:
    """A boolean environment variable (:data:`BOOLEAN`); ``None`` when unset or blank."""
    return parse_env(name, BOOLEAN, kind="a boolean", accepted=BOOLEAN_TEXT, environ=environ)
