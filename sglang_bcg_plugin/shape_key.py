"""``ShapeKey``: the identity of one captured graph."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ShapeKey:
    """Identity of one captured graph.

    :param size: number of tokens (prefill) or requests (decode) the graph was captured for;
        an ``int`` >= 1.
    :param stream_idx: PDMux stream the graph replays on, or ``None`` for the default stream.
        Graphs of different streams may replay concurrently, so they never share output memory.
    :param variant_label: free-form label (attention variant, spec-decode mode, ...) that makes
        otherwise equal keys distinct graphs; ``None`` or a non-empty ``str``.
    """

    size: int
    stream_idx: int | None = None
    variant_label: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int):
            msg = f"ShapeKey.size must be an int >= 1, got {self.size!r} ({type(self.size).__name__})"
            raise TypeError(msg)
        if self.size < 1:
            msg = f"ShapeKey.size must be an int >= 1, got {self.size!r}"
            raise ValueError(msg)
        if self.stream_idx is not None:
            if isinstance(self.stream_idx, bool) or not isinstance(self.stream_idx, int):
                msg = (
                    "ShapeKey.stream_idx must be None or an int >= 0, "
                    f"got {self.stream_idx!r} ({type(self.stream_idx).__name__})"
                )
                raise TypeError(msg)
            if self.stream_idx < 0:
                msg = f"ShapeKey.stream_idx must be None or an int >= 0, got {self.stream_idx!r}"
                raise ValueError(msg)
        if self.variant_label is not None:
            if not isinstance(self.variant_label, str):
                msg = (
                    "ShapeKey.variant_label must be None or a non-empty str, "
                    f"got {self.variant_label!r} ({type(self.variant_label).__name__})"
                )
                raise TypeError(msg)
            if not self.variant_label:
                msg = "ShapeKey.variant_label must be None or a non-empty str, got ''"
                raise ValueError(msg)


def check_key(key: object) -> Hashable:
    """Validate a key from any source (ours or SGLang's) and return it.

    A key is any hashable object with ``size`` (int >= 1) and ``stream_idx`` (None or int)
    attributes; keys are kept distinct by their own equality, so SGLang's four-field
    ``ShapeKey`` works unchanged.
    """
    size = getattr(key, "size", None)
    if not hasattr(key, "stream_idx") or size is None:
        msg = (
            f"shape key {key!r} ({type(key).__name__}) needs 'size' and 'stream_idx' "
            "attributes; use sglang_bcg_plugin.ShapeKey or SGLang's ShapeKey"
        )
        raise TypeError(msg)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        msg = f"shape key {key!r} has size {size!r}; expected an int >= 1"
        raise ValueError(msg)
    try:
        hash(key)
    except TypeError:
        msg = f"shape key {key!r} ({type(key).__name__}) is not hashable"
        raise TypeError(msg) from None
    return key  # type: ignore[return-value]
