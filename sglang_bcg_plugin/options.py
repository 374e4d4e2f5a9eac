"""Backend options: every field checked, names normalised (any case), on construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ._words import parse_word
from .output_mode import OutputMode, parse_output_mode

EngineName = Literal["auto", "cuda", "eager"]
ENGINES: tuple[EngineName, ...] = ("auto", "cuda", "eager")
SharedBufferSource = Literal["auto", "adopt", "reserve"]
SHARED_BUFFER_SOURCES: tuple[SharedBufferSource, ...] = ("auto", "adopt", "reserve")
PoolReserve = Literal["off", "auto"] | int
PoolSegments = Literal["fixed", "expandable"]
POOL_SEGMENTS: tuple[PoolSegments, ...] = ("fixed", "expandable")


def _names(names: tuple[str, ...]) -> dict[str, str]:
    return {n: n for n in names}


def parse_pool_segments(raw: object, *, what: str = "BackendOptions.pool_segments") -> str:
    """``"fixed"`` or ``"expandable"`` (any case, whitespace allowed).

    :raises TypeError: not a str. :raises ValueError: another word (both name ``what``).
    """
    return parse_word(raw, _names(POOL_SEGMENTS), what, kind="a pool segment setting")


def parse_pool_reserve(raw: object, *, what: str = "BackendOptions.pool_reserve") -> str | int:
    """``"off"``, ``"auto"`` (any case, whitespace allowed) or bytes as an int >= 0 (0 is ``"off"``).

    :raises TypeError: neither a str nor an int (a bool is refused).
    :raises ValueError: another word, or a negative int.
    """
    accepted = "'off', 'auto' or bytes as an int >= 0"
    if isinstance(raw, int) and not isinstance(raw, bool):
        if raw < 0:
            msg = f"{what} must be {accepted}, got {raw!r}"
            raise ValueError(msg)
        return raw if raw else "off"
    return parse_word(raw, _names(("off", "auto")), what, kind="a pool reserve", accepted=accepted)


def parse_shared_buffer(raw: object, *, what: str = "BackendOptions.shared_buffer") -> SharedBufferSource:
    """A buffer source: ``auto``, ``adopt`` or ``reserve`` (any case, whitespace allowed); returned lowercase.

    :raises TypeError: ``raw`` is not a str.
    :raises ValueError: not one of the names (``what`` and the value are named).
    """
    return parse_word(raw, _names(SHARED_BUFFER_SOURCES), what, kind="a buffer source")  # type: ignore[return-value]


def _check_bool(field: str, value: object) -> None:
    if not isinstance(value, bool):
        msg = f"BackendOptions.{field} must be True or False, got {value!r} of type {type(value).__name__}"
        raise TypeError(msg)


@dataclass(frozen=True, slots=True)
class BackendOptions:
    """Settings of one backend instance; every field is type-checked on construction.

    :param output_mode: ``"off"``, ``"on"`` or ``"released"`` (any case); ``None``: follow the
        switch, resolved at the start of every capture session (:mod:`~sglang_bcg_plugin.output_mode`).
    :param strict_outputs: raise :class:`OutputStructureError` when a key's output does not fit
        the shared buffer, instead of that key keeping its own output with a warning.
    :param engine: ``"cuda"``, ``"eager"`` (static-output semantics without graphs) or ``"auto"``
        (CUDA when available); any case.
    :param num_warmups: eager runs before each capture.
    :param stale_output_guard: poison views handed out by an earlier replay of another key of
        the same partition so a stale read raises (debug aid; needs
        ``torch._C._set_storage_access_error_msg``).
    :param shared_buffer: the shared buffer's source with sharing on: ``"adopt"`` (the largest
        capture's output), ``"reserve"`` (allocated before the first capture) or ``"auto"``
        (docs/index.md, "Output sharing"); any case.
    :param pool_reserve: on CUDA, a block the graph pool starts with: ``"off"``, ``"auto"`` (what
        a forecast of this schedule found, else none) or bytes (docs/forecast.md).
    :param pool_segments: on CUDA, ``"fixed"`` (the process's setting) or ``"expandable"``
        (``expandable_segments`` on while a capture session is open, for every allocation in it;
        docs/forecast.md).
    :param debug_check_inputs: every ``replay`` checks that each tensor of the key's
        ``capture_inputs`` still has its capture-time data pointer, else raises ``RuntimeError``
        naming the key and the input's path. Read when a capture session opens.
    :raises TypeError: a field of the wrong type (``strict_outputs="no"``, ``num_warmups=2.0``).
    :raises ValueError: ``output_mode``, ``engine``, ``shared_buffer``, ``pool_reserve`` or
        ``pool_segments`` not one of its names, ``num_warmups < 0``.
    """

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
        object.__setattr__(self, "output_mode", parse_output_mode(self.output_mode))
        object.__setattr__(self, "shared_buffer", parse_shared_buffer(self.shared_buffer))
        object.__setattr__(self, "pool_reserve", parse_pool_reserve(self.pool_reserve))
        object.__setattr__(self, "pool_segments", parse_pool_segments(self.pool_segments))
        _check_bool("strict_outputs", self.strict_outputs)
        _check_bool("stale_output_guard", self.stale_output_guard)
        _check_bool("debug_check_inputs", self.debug_check_inputs)
        object.__setattr__(self, "engine", parse_word(self.engine, _names(ENGINES), "BackendOptions.engine", kind="an engine"))
        if isinstance(self.num_warmups, bool) or not isinstance(self.num_warmups, int):
            msg = (
                f"BackendOptions.num_warmups must be an int >= 0, got {self.num_warmups!r} "
                f"of type {type(self.num_warmups).__name__}"
            )
            raise TypeError(msg)
        if self.num_warmups < 0:
            msg = f"BackendOptions.num_warmups must be an int >= 0, got {self.num_warmups!r}"
            raise ValueError(msg)
