"""``ShapeKey``: the identity of one captured graph."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ShapeKey:
    """Identity of one captured graph.

    :param size: tokens (prefill) or requests (decode) the graph was captured for; an int >= 1.
    :param stream_idx: PDMux stream the graph replays on (``None``: the default stream); graphs of
        different streams never share output memory.
    :param variant_label: free-form label that makes otherwise equal keys distinct graphs;
        ``None`` or a non-empty ``str``.
    :raises TypeError, ValueError: a field out of its type or range."""

    size: int
    stream_idx: int | None = None
    variant_label: str | None = None

    def __post_init__(self) -> None:
        size, stream, label = self.size, self.stream_idx, self.variant_label
        _check("size", size, "an int >= 1", _is_int(size), _is_int(size) and size >= 1)
        _check("stream_idx", stream, "None or an int >= 0", stream is None or _is_int(stream),
               stream is None or (_is_int(stream) and stream >= 0))
        _check("variant_label", label, "None or a non-empty str", label is None or isinstance(label, str),
               label is None or (isinstance(label, str) and label != ""))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(name: str, value: object, want: str, typed: bool, valid: bool) -> None:
    if not typed:
        raise TypeError(f"ShapeKey.{name} must be {want}, got {value!r} ({type(value).__name__})")
    if not valid:
        raise ValueError(f"ShapeKey.{name} must be {want}, got {value!r}")
