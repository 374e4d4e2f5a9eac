"""Backend options: every field checked, names normalised (any case), on construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ._words import parse_word
from .output.mode import OutputMode, parse_mode

EngineName = Literal["auto", "cuda", "eager"]
SharedBufferSource = Literal["auto", "adopt", "reserve"]
PoolReserve = Literal["off", "auto"] | int
PoolSegments = Literal["fixed", "expandable"]

#: The fields that take a word: their words, and what a value is (for the message).
_WORDS = {
    "shared_buffer": (("auto", "adopt", "reserve"), "a buffer source"),
    "pool_segments": (("fixed", "expandable"), "a pool segment setting"),
    "engine": (("auto", "cuda", "eager"), "an engine"),
}


def _int(field: str, value: object, accepted: str) -> int:
    """``value``, an int >= 0 (a bool is refused).

    :raises TypeError: not an int. :raises ValueError: negative (both name the field)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"BackendOptions.{field} must be {accepted}, got {value!r} of type {type(value).__name__}")
    if value < 0:
        raise ValueError(f"BackendOptions.{field} must be {accepted}, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class BackendOptions:
    """Settings of one backend instance; every field is type-checked on construction.

    :param output_mode: ``"off"``, ``"on"``, ``"released"``; ``None``: the switch, read at every session.
    :param strict_outputs: raise :class:`OutputStructureError` where a key's output does not fit the shared buffer,
        instead of that key keeping its own output with a warning.
    :param engine: ``"cuda"``, ``"eager"`` (static outputs without graphs) or ``"auto"`` (CUDA when available).
    :param num_warmups: eager runs before each capture.
    :param stale_output_guard: a stale read of an earlier replay's output raises (docs/reliability.md).
    :param shared_buffer: ``"adopt"``, ``"reserve"`` or ``"auto"`` (docs/index.md#output-sharing).
    :param pool_reserve: CUDA: ``"off"``, ``"auto"`` (the forecast's block) or bytes (docs/forecast.md).
    :param pool_segments: CUDA: ``"fixed"`` or ``"expandable"`` during a session (docs/forecast.md).
    :param debug_check_inputs: every ``replay`` raises ``RuntimeError`` where a ``capture_inputs`` tensor moved from its
        capture-time data pointer.
    :raises TypeError: a field of the wrong type (``strict_outputs="no"``, ``num_warmups=2.0``).
    :raises ValueError: a word field not one of its names, ``num_warmups < 0``."""

    output_mode: OutputMode | None = None
    strict_outputs: bool = False
    engine: EngineName = "auto"
    num_warmups: int = 2
    stale_output_guard: bool = False
    shared_buffer: SharedBufferSource = "auto"
    pool_reserve: PoolReserve = "off"
    pool_segments: PoolSegments = "fixed"
    debug_check_inputs: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "output_mode", parse_mode(self.output_mode))
        for field, (names, kind) in _WORDS.items():
            word = parse_word(getattr(self, field), {n: n for n in names}, f"BackendOptions.{field}", kind=kind)
            object.__setattr__(self, field, word)
        accepted = "'off', 'auto' or bytes as an int >= 0"
        reserve: PoolReserve
        if isinstance(self.pool_reserve, str):
            words: dict[str, PoolReserve] = {"off": "off", "auto": "auto"}
            reserve = parse_word(self.pool_reserve, words, "BackendOptions.pool_reserve",
                                 kind="a pool reserve", accepted=accepted)
        else:  # 0 bytes is "off"
            reserve = _int("pool_reserve", self.pool_reserve, accepted) or "off"
        object.__setattr__(self, "pool_reserve", reserve)
        for field in ("strict_outputs", "stale_output_guard", "debug_check_inputs"):
            value = getattr(self, field)
            if not isinstance(value, bool):
                msg = f"BackendOptions.{field} must be True or False, got {value!r} of type {type(value).__name__}"
                raise TypeError(msg)
        _int("num_warmups", self.num_warmups, "an int >= 0")
