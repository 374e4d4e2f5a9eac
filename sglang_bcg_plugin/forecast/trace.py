"""Allocation traces of one capture (:class:`KeyTrace`), and how they scale with the capture size
(:class:`ScaledTrace`: one line per alloc, ``bytes(n) = a + b * n``; docs/forecast.md)."""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

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

    @property
    def shape(self) -> tuple[tuple[int, int], ...]:
        """``ops`` with the allocs' bytes zeroed: the sequence of requests."""
        return tuple((k, v if k == 1 else 0) for k, v in self.ops)


def inside(addr: int, segments: Sequence[tuple[int, int]]) -> bool:
    """Whether ``addr`` falls in one of ``segments`` (``(address, bytes)``)."""
    return any(lo <= addr < lo + n for lo, n in segments)


def pool_trace(size: int, events: Iterable[dict[str, object]], segments: Sequence[tuple[int, int]]) -> KeyTrace:
    """The :class:`KeyTrace` of the allocator's events in ``segments`` (``(address, bytes)`` of the capture's pool)."""
    ops: list[tuple[int, int]] = []
    live: dict[int, int] = {}
    for e in events:
        addr = int(e["addr"])  # type: ignore[call-overload]
        if not inside(addr, segments):
            continue
        if e["action"] == ALLOC:
            live[addr] = len(ops)
            ops.append((0, int(e["size"])))  # type: ignore[call-overload]
        elif e["action"] == FREE_COMPLETED and addr in live:
            ops.append((1, live.pop(addr)))
    return KeyTrace(size, tuple(ops))


def pinned_slack(events: Iterable[dict[str, object]], segments: Sequence[tuple[int, int]]) -> int:
    """Bytes of segments made outside the pool ``segments`` during ``events`` beyond what the blocks
    still live in them would have made alone (docs/forecast.md)."""
    made: dict[int, int] = {}
    live: dict[int, int] = {}
    for e in events:
        addr, action = int(e["addr"]), e["action"]  # type: ignore[call-overload]
        if inside(addr, segments):
            continue
        book = made if action in (SEGMENT_ALLOC, SEGMENT_FREE) else live
        if action in (SEGMENT_ALLOC, ALLOC):
            book[addr] = int(e["size"])  # type: ignore[call-overload]
        elif action in (SEGMENT_FREE, FREE_COMPLETED):
            book.pop(addr, None)
    held: dict[int, int] = {}
    for addr, size in live.items():
        lo = next((lo for lo, n in made.items() if lo <= addr < lo + n), None)
        if lo is not None:
            held[lo] = held.get(lo, 0) + size
    return sum(max(0, made[lo] - segment_size(round_size(n))) for lo, n in held.items())


@dataclass(frozen=True, slots=True)
class ScaledTrace:
    """Traces of one forward at any size, one line per op."""

    shape: tuple[tuple[int, int], ...]  # ops with frees as in the probes, allocs' bytes unused
    lines: tuple[tuple[float, float], ...]  # per op: (a, b) of bytes = a + b * size (allocs)
    #: sizes whose forward allocates in another sequence than the lines', each as its probe
    #: recorded it, with the indices of its output allocs
    alone: tuple[tuple[KeyTrace, frozenset[int]], ...] = ()
    _at: dict[int, KeyTrace] = field(default_factory=dict, compare=False, repr=False)  # :meth:`at`'s, per size

    def outputs_at(self, size: int, outputs: frozenset[int]) -> frozenset[int]:
        """The output allocs at ``size``: ``outputs`` (the lines') unless ``size`` is one of :attr:`alone`."""
        return next((outs for trace, outs in self.alone if trace.size == size), outputs)

    @classmethod
    def fit(cls, large: KeyTrace, small: KeyTrace) -> ScaledTrace:
        """The lines through the two traces' allocations, paired by position where the two are the
        same sequence, else by :func:`pair_allocs`. :raises ForecastError: the two probe sizes are
        equal, or the allocations cannot be paired."""
        if large.size == small.size:
            raise ForecastError(f"forecast: the two probe sizes must differ (both {large.size})")
        shape = large.shape
        pairs = {i: i for i, (k, _) in enumerate(large.ops) if k == 0} if shape == small.shape else (
            pair_allocs(large, small))
        def line(bl: int, bs: int) -> tuple[float, float]:
            b = (bl - bs) / (large.size - small.size)
            return bs - b * small.size, b

        return cls(shape, tuple((0.0, 0.0) if k == 1 else line(bl, small.ops[pairs[i]][1])
                                for i, (k, bl) in enumerate(large.ops)))

    @classmethod
    def proportional(cls, trace: KeyTrace, constant_below: int = 64 * 1024) -> ScaledTrace:
        """One trace alone: requests of ``constant_below`` bytes or more scale with the size, smaller
        ones stay constant. :raises ForecastError: ``trace.size`` is not positive."""
        if trace.size <= 0:
            raise ForecastError(f"forecast: the probe size must be positive, got {trace.size}")
        lines = tuple((0.0, 0.0) if k == 1 else ((float(v), 0.0) if v < constant_below else (0.0, v / trace.size))
                      for k, v in trace.ops)
        return cls(trace.shape, lines)

    def at(self, size: int) -> KeyTrace:
        """The trace at ``size`` tokens (bytes rounded up to whole bytes, at least 1; a size of
        :attr:`alone` as its probe recorded it), made once per size."""
        if size not in self._at:
            self._at[size] = next((t for t, _ in self.alone if t.size == size), None) or KeyTrace(
                size, tuple((kind, v) if kind == 1 else (0, max(1, int(-(-(a + b * size) // 1))))
                            for (kind, v), (a, b) in zip(self.shape, self.lines, strict=True)))
        return self._at[size]


#: Bytes within which an allocation's bytes count as proportional to the capture size (the
#: allocator's rounding, 512 bytes, at the smaller size).
PROPORTIONAL_SLACK = 512


def pair_allocs(large: KeyTrace, small: KeyTrace) -> dict[int, int]:
    """Pair the allocations of two probes whose requests come in another order by what each is
    (docs/forecast.md#how-it-works): ``{index in large.ops: its pair's index in small.ops}``.
    :raises ForecastError: the counts of allocations (or kept ones) differ, or one finds no pair."""
    def allocs(trace: KeyTrace) -> list[tuple[int, int, bool]]:
        kept = set(trace.kept)
        return [(i, v, i in kept) for i, (k, v) in enumerate(trace.ops) if k == 0]

    al, as_ = allocs(large), allocs(small)
    head = f"forecast: the forward's allocations at {large.size} and {small.size} tokens differ in sequence"
    kept_l, kept_s = sum(k for *_, k in al), sum(k for *_, k in as_)
    if len(al) != len(as_) or kept_l != kept_s:
        raise ForecastError(f"{head} and cannot be paired: {len(al)} allocations ({kept_l} kept) against {len(as_)} "
                            f"({kept_s} kept) in {len(large.ops)} vs {len(small.ops)} requests; its memory does not "
                            "scale as one pattern, so it cannot be forecast from two probes")
    (big, lo), (n_big, n_lo) = ((al, as_), (large.size, small.size)) if large.size > small.size else (
        (as_, al), (small.size, large.size))

    def proportional(bl: int, bs: int) -> bool:
        return bl != bs and abs(bl * n_lo - bs * n_big) <= PROPORTIONAL_SLACK * n_big

    pairs: dict[int, int] = {}  # op index in big's trace -> in lo's
    free = list(lo)
    for rule in (operator.eq, proportional, operator.ge):  # the same bytes, in proportion, not fewer
        for i, bl, kl in big:
            j = None if i in pairs else next(
                (j for j, (_, bs, ks) in enumerate(free) if ks == kl and rule(bl, bs)), None)
            if j is not None:
                pairs[i] = free.pop(j)[0]
    unpaired = [(a, alloc) for a, alloc in enumerate(big) if alloc[0] not in pairs]
    if unpaired:
        a, (_, bytes_, kept) = unpaired[0]
        msg = (f"{head} and cannot be paired: the {'kept' if kept else 'freed'} allocation of {bytes_} bytes at "
               f"{n_big} tokens (#{a} of {len(big)}) has no allocation at {n_lo} tokens of the same bytes, bytes in "
               "proportion or fewer bytes; its memory does not scale as one pattern, so it cannot be forecast from "
               "two probes")
        raise ForecastError(msg)
    return pairs if big is al else {j: i for i, j in pairs.items()}


def output_allocs(trace: KeyTrace, output_bytes: Sequence[int], among: Sequence[int] | None = None) -> frozenset[int]:
    """The output's allocs, matched by bytes among ``among`` (default: those ``trace`` keeps), first one first."""
    wanted = list(output_bytes)
    found = []
    for i in trace.kept if among is None else among:
        if trace.ops[i][1] in wanted:
            found.append(i)
            wanted.remove(trace.ops[i][1])
    return frozenset(found)
