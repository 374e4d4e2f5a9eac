"""Allocation traces of one capture, and how they scale with the capture size.

A :class:`KeyTrace` is what one key's capture asked of its graph pool, in order: ``alloc`` (an
index and the requested bytes) and ``free`` (of an earlier alloc); the allocs still live when
the capture ends are what the graph keeps (its output, and whatever the forward holds on to).
:func:`pool_trace` reads it from the events PyTorch's allocator records
(``torch.cuda.memory._record_memory_history``), keeping the events inside the given pool's
segments. :class:`ScaledTrace` fits two traces of the same forward at two sizes (same
sequence of allocs and frees, which a tokens-first forward has) with one line per alloc,
``bytes(n) = a + b * n``, and writes the trace of any other size.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..errors import ForecastError
from .allocator import round_size, segment_size

ALLOC, FREE_COMPLETED = "alloc", "free_completed"
SEGMENT_ALLOC, SEGMENT_FREE = "segment_alloc", "segment_free"


@dataclass(frozen=True, slots=True)
class KeyTrace:
    """One capture's pool requests: ``ops`` are ``(0, bytes)`` allocs and ``(1, alloc index)`` frees."""

    size: int
    ops: tuple[tuple[int, int], ...]

    @property
    def kept(self) -> tuple[int, ...]:
        """Indices (into ``ops``) of the allocs never freed within the capture."""
        freed = {i for kind, i in self.ops if kind == 1}
        return tuple(i for i, (kind, _) in enumerate(self.ops) if kind == 0 and i not in freed)

    def kept_bytes(self) -> int:
        return sum(self.ops[i][1] for i in self.kept)


def _inside(addr: int, segments: Sequence[tuple[int, int]]) -> bool:
    return any(lo <= addr < lo + n for lo, n in segments)


def pool_trace(size: int, events: Iterable[dict[str, object]], segments: Sequence[tuple[int, int]]) -> KeyTrace:
    """The :class:`KeyTrace` of the events (allocator trace entries: ``action``, ``addr``,
    ``size``) that fall in ``segments`` (``(address, bytes)`` of the capture's pool)."""
    ops: list[tuple[int, int]] = []
    live: dict[int, int] = {}
    for e in events:
        addr = int(e["addr"])  # type: ignore[call-overload]
        if not _inside(addr, segments):
            continue
        if e["action"] == ALLOC:
            live[addr] = len(ops)
            ops.append((0, int(e["size"])))  # type: ignore[call-overload]
        elif e["action"] == FREE_COMPLETED and addr in live:
            ops.append((1, live.pop(addr)))
    return KeyTrace(size, tuple(ops))


def pinned_slack(events: Iterable[dict[str, object]], segments: Sequence[tuple[int, int]]) -> int:
    """Bytes of segments made outside the pool ``segments`` that stay reserved only because a
    smaller live block sits in them.

    Per segment made during ``events`` and still holding live blocks at their end: its bytes
    less the segment those blocks alone would have made. When the first probe compiles on a cold
    Inductor cache, autotuning makes large segments and frees them; the capture stream's cuBLAS
    workspace then lands in one of them and pins all of it, which a later schedule (its kernels
    compiled) never pays (docs/forecast.md gives the figures). A segment with no live block is
    released by ``empty_cache`` and costs nothing.
    """
    made: dict[int, int] = {}
    live: dict[int, int] = {}
    for e in events:
        addr, action = int(e["addr"]), e["action"]  # type: ignore[call-overload]
        if _inside(addr, segments):
            continue
        size = int(e["size"])  # type: ignore[call-overload]
        if action == SEGMENT_ALLOC:
            made[addr] = size
        elif action == SEGMENT_FREE:
            made.pop(addr, None)
        elif action == ALLOC:
            live[addr] = size
        elif action == FREE_COMPLETED:
            live.pop(addr, None)
    held: dict[int, int] = {}
    for addr, size in live.items():
        lo = next((lo for lo, n in made.items() if lo <= addr < lo + n), None)
        if lo is not None:
            held[lo] = held.get(lo, 0) + size
    return sum(max(0, made[lo] - segment_size(round_size(n))) for lo, n in held.items())


@dataclass(frozen=True, slots=True)
class ScaledTrace:
    """Traces of one forward at any size, from two measured ones (see the module doc)."""

    shape: tuple[tuple[int, int], ...]  # ops with frees as in the probes, allocs' bytes unused
    lines: tuple[tuple[float, float], ...]  # per op: (a, b) of bytes = a + b * size (allocs)

    @classmethod
    def fit(cls, large: KeyTrace, small: KeyTrace) -> ScaledTrace:
        """:raises ForecastError: the two traces are not the same sequence of requests."""
        if large.size == small.size:
            msg = f"forecast: the two probe sizes must differ (both {large.size})"
            raise ForecastError(msg)
        kinds_l = [(k, v if k == 1 else 0) for k, v in large.ops]
        kinds_s = [(k, v if k == 1 else 0) for k, v in small.ops]
        if kinds_l != kinds_s:
            msg = (
                f"forecast: the forward's allocations at {large.size} and {small.size} tokens differ in "
                f"sequence ({len(large.ops)} vs {len(small.ops)} requests): its memory does not scale "
                "as one pattern, so it cannot be forecast from two probes"
            )
            raise ForecastError(msg)
        lines = []
        for (k, bl), (_, bs) in zip(large.ops, small.ops, strict=True):
            if k == 1:
                lines.append((0.0, 0.0))
                continue
            b = (bl - bs) / (large.size - small.size)
            lines.append((bs - b * small.size, b))
        return cls(tuple(kinds_l), tuple(lines))

    @classmethod
    def proportional(cls, trace: KeyTrace, constant_below: int = 64 * 1024) -> ScaledTrace:
        """One trace alone (the largest size's): requests of ``constant_below`` bytes or more
        scale with the size (``b * n``), smaller ones stay as they are. What a capture path that
        sees only its first size can fit (inside SGLang; its accuracy: docs/sglang.md)."""
        if trace.size <= 0:
            msg = f"forecast: the probe size must be positive, got {trace.size}"
            raise ForecastError(msg)
        shape = tuple((k, v if k == 1 else 0) for k, v in trace.ops)
        lines = tuple(
            (0.0, 0.0) if k == 1 else ((float(v), 0.0) if v < constant_below else (0.0, v / trace.size))
            for k, v in trace.ops
        )
        return cls(shape, lines)

    def at(self, size: int) -> KeyTrace:
        """The trace at ``size`` tokens (bytes rounded up to whole bytes, at least 1)."""
        ops = []
        for (kind, v), (a, b) in zip(self.shape, self.lines, strict=True):
            ops.append((kind, v) if kind == 1 else (0, max(1, int(-(-(a + b * size) // 1)))))
        return KeyTrace(size, tuple(ops))


def output_allocs(trace: KeyTrace, output_bytes: Sequence[int]) -> frozenset[int]:
    """The allocs ``trace`` keeps that hold the output: matched by bytes (a storage's bytes are
    the bytes its allocation asked for), first kept alloc first."""
    wanted = list(output_bytes)
    found = []
    for i in trace.kept:
        size = trace.ops[i][1]
        if size in wanted:
            found.append(i)
            wanted.remove(size)
    return frozenset(found)
