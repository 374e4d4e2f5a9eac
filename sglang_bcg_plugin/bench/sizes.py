"""SGLang's prefill capture sizes (``generate_prefill_cuda_graph_batch_sizes``, 0.5.23)."""

from __future__ import annotations

from typing import NamedTuple

#: The smallest prefill capture size of SGLang's schedule.
MIN_CAPTURE_SIZE = 4

#: (start, stop or None for unbounded, step) of each run of the schedule.
_RUNS = ((4, 33, 4), (48, 257, 16), (288, 513, 32), (576, 1025, 64), (1280, 4097, 256), (4608, None, 512))


class SizeStats(NamedTuple):
    """Count, sum and largest of the capture sizes up to a ``max_tokens``."""

    num: int
    total: int
    largest: int


def _runs(max_tokens: int) -> list[range]:
    """The schedule's runs, each cut at ``max_tokens`` (lazy ``range`` objects). :raises ValueError: not an int >= 4."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < MIN_CAPTURE_SIZE:
        msg = f"max_tokens must be an int >= {MIN_CAPTURE_SIZE} (the smallest prefill capture size), got {max_tokens!r}"
        raise ValueError(msg)
    return [range(start, min(stop or max_tokens + 1, max_tokens + 1), step) for start, stop, step in _RUNS]


def capture_size_stats(max_tokens: int) -> SizeStats:
    """:func:`prefill_capture_sizes`' length, sum and maximum, in constant time."""
    count = total = largest = 0
    for r in filter(None, _runs(max_tokens)):  # len() overflows past 2**63
        n = (r[-1] - r.start) // r.step + 1
        count, total, largest = count + n, total + n * (r.start + r[-1]) // 2, r[-1]
    return SizeStats(count, total, largest)


def prefill_capture_sizes(max_tokens: int) -> list[int]:
    """Token counts SGLang 0.5.23 captures for prefill, ascending, up to ``max_tokens``."""
    return [s for r in _runs(max_tokens) for s in r]
