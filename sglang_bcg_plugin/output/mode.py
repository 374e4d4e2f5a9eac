"""The output mode (``off``, ``on`` or ``released``; docs/index.md#the-switch-output-modes) and its
resolution: explicit option > a host's :class:`Resolution` > ``SGLANG_ENABLE_BCG_SHARED_OUTPUT`` > default."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from .._constants import ENV_SHARE_OUTPUT
from .._words import BOOLEAN, BOOLEAN_TEXT, parse_word

OutputMode = Literal["off", "on", "released"]
OFF: OutputMode = "off"
ON: OutputMode = "on"
RELEASED: OutputMode = "released"
MODES: tuple[OutputMode, ...] = (OFF, ON, RELEASED)

#: A textual mode (the environment variable, the flag): a boolean (sharing on/off) or ``released``.
TEXT_WORDS: dict[str, OutputMode] = {**{word: ON if on else OFF for word, on in BOOLEAN.items()}, RELEASED: RELEASED}
#: What every "not a mode" error of a textual mode lists (the boolean spellings first).
ACCEPTED_TEXT = f"{BOOLEAN_TEXT} (sharing on/off) or released"

#: The option's name and what it accepts, in every error about ``BackendOptions.output_mode``.
OPTION = "BackendOptions.output_mode"
OPTION_ACCEPTS = f"'off', 'on', 'released' or None (follow --enable-bcg-shared-output / {ENV_SHARE_OUTPUT})"


def parse_mode(value: object, what: str = OPTION, *, text: bool = False) -> OutputMode | None:
    """The one parser of an output mode, wherever one is given; ``None`` where none is set.

    ``text=False``: a value (``BackendOptions.output_mode``, a request's ``"mode"``): ``off``,
    ``on`` or ``released`` in any case, or ``None``; a bool is refused, saying which mode it meant.
    ``text=True``: a switch's text (the environment variable, the flag's value): also the boolean
    words of :data:`ACCEPTED_TEXT`; unset or blank is ``None``.

    :raises ValueError: a string that is not a mode. :raises TypeError: anything else; both name
        ``what``, the value and what is accepted."""
    if text:
        if value is None or (isinstance(value, str) and not value.strip()):
            return None
        return parse_word(value, TEXT_WORDS, what, kind="an output mode", accepted=ACCEPTED_TEXT)
    if value is None:
        return None
    accepted = OPTION_ACCEPTS if what == OPTION else "'off', 'on' or 'released'"
    if isinstance(value, bool):
        hint = f"{'output_mode=' if what == OPTION else ''}{'on' if value else 'off'!r}"
        raise TypeError(f"{what} must be {accepted}, got {value!r} of type bool (use {hint})")
    return parse_word(value, {mode: mode for mode in MODES}, what, kind="an output mode", accepted=accepted)


def mode_of_option(value: bool | str | None) -> OutputMode | None:
    """The mode of a bench variant's or a test's ``share`` (``True`` = ``on``, ``False`` = ``off``)
    or of an ``output_mode`` value (:func:`parse_mode`); ``None``: not set."""
    if isinstance(value, bool):
        return ON if value else OFF
    return parse_mode(value)


@dataclass(frozen=True, slots=True)
class Resolution:
    """A resolved output mode and where it came from (for logs and ``sglang-bcg doctor``)."""

    mode: OutputMode
    source: str

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"Resolution.mode must be one of {', '.join(map(repr, MODES))}, got {self.mode!r}")

    def describe(self) -> str:
        return f"{self.mode} ({self.source})"


def explain_output_mode(explicit: str | Resolution | None = None, *, environ: Mapping[str, str] | None = None,
                        default: OutputMode = OFF, default_reason: str = "default: off") -> Resolution:
    """The output mode and why (precedence: the module docstring); ``explicit``: an option value, a
    host's :class:`Resolution` (returned as it is), or ``None``.

    :raises TypeError, ValueError: ``explicit`` or the environment variable is not a mode."""
    if isinstance(explicit, Resolution):
        return explicit
    mode = parse_mode(explicit)
    if mode is not None:
        return Resolution(mode, f"BackendOptions.output_mode={mode!r}")
    raw = (os.environ if environ is None else environ).get(ENV_SHARE_OUTPUT)
    from_env = parse_mode(raw, ENV_SHARE_OUTPUT, text=True)
    if from_env is not None:
        return Resolution(from_env, f"{ENV_SHARE_OUTPUT}={raw!r}")
    return Resolution(default, default_reason)


def resolve_output_mode(explicit: str | Resolution | None = None, *, environ: Mapping[str, str] | None = None,
                        default: OutputMode = OFF) -> OutputMode:
    """:func:`explain_output_mode` without the reason."""
    return explain_output_mode(explicit, environ=environ, default=default).mode
