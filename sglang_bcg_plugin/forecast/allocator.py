"""A model of PyTorch's CUDA caching allocator for one memory pool (no CUDA needed): its rules,
fixed or ``expandable_segments``, are listed in docs/forecast.md#how-it-works."""

from __future__ import annotations

import bisect
import os
import random
from collections.abc import Iterable
from dataclasses import dataclass, field

MB = 1 << 20
MIN_BLOCK = 512
SMALL_SIZE = 1 * MB
SMALL_BUFFER = 2 * MB
LARGE_BUFFER = 20 * MB
MIN_LARGE_ALLOC = 10 * MB
ROUND_LARGE = 2 * MB
#: Environment variables of the CUDA allocator's settings (the second is torch >= 2.9's name).
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def expandable_segments(environ: dict[str, str] | None = None) -> bool:
    """Whether ``environ``'s (default: the process's) :data:`ALLOC_CONF_VARS` turn ``expandable_segments`` on."""
    env = os.environ if environ is None else environ
    items = (item.partition(":") for var in ALLOC_CONF_VARS for item in env.get(var, "").split(","))
    return any(key.strip() == "expandable_segments" and value.strip().lower() == "true" for key, _, value in items)


#: Request kinds of :meth:`PoolModel.run`: allocate bytes, free the block an earlier op of the same
#: run allocated (by its index), free a block by address.
ALLOC, FREE, FREE_ADDR = 0, 1, 2


def round_size(size: int) -> int:
    """The bytes a request of ``size`` takes from a block."""
    return MIN_BLOCK * max(1, -(-size // MIN_BLOCK))


def segment_size(size: int) -> int:
    """The bytes of the segment created for a rounded request of ``size`` that found no block."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * ((size + ROUND_LARGE - 1) // ROUND_LARGE)


class _Block:
    __slots__ = ("addr", "size", "small", "stream", "free", "prev", "next")

    def __init__(self, addr: int, size: int, small: bool, stream: int, free: bool = True,
                 prev: _Block | None = None, next: _Block | None = None) -> None:  # noqa: A002
        self.addr, self.size, self.small, self.stream = addr, size, small, stream
        self.free, self.prev, self.next = free, prev, next


@dataclass
class PoolModel:
    """One pool's segments and blocks (free ones in one list sorted by ``(small, stream, size,
    addr)``: best fit is a bisection); ``malloc`` returns a handle for ``free``."""

    segments: list[int] = field(default_factory=list)  # sizes, in creation order (expandable: mapped bytes)
    #: ``expandable_segments``: one growing segment per (small, stream).
    expandable: bool = False
    #: new segments above every earlier one (default: below, as cudaMalloc hands them out at first).
    ascending: bool = False
    #: where set, each new segment at an address drawn from this seed (an order cudaMalloc may give).
    order_seed: int | None = None
    _grown: dict[tuple[bool, int], tuple[int, _Block]] = field(default_factory=dict)  # segment index, its first block
    _free: list[tuple[bool, int, int, int]] = field(default_factory=list)  # (small, stream, size, addr), sorted
    _by_addr: dict[int, _Block] = field(default_factory=dict)
    _next_addr: int = 0  # expandable: the next virtual range
    _next_segment: int = 1 << 62  # the last segment's address
    _rng: random.Random | None = None  # order_seed's draws
    allocated_bytes: int = 0
    peak_allocated_bytes: int = 0

    @property
    def reserved_bytes(self) -> int:
        return sum(self.segments)

    def malloc(self, size: int, stream: int = 0) -> int:
        """Allocate ``size`` bytes; returns the block's address (the handle for :meth:`free`)."""
        return self.run(((ALLOC, size),), stream)[0]

    def free(self, addr: int) -> None:
        """Return the block at ``addr``; it merges with free neighbours of its segment."""
        self.run(((FREE_ADDR, addr),))

    def reserve(self, nbytes: int) -> None:
        """What ``torch.empty(nbytes)`` allocated in the pool and freed at once leaves: from 10 MiB
        a segment of its own (``nbytes`` rounded up to 2 MiB), then one free block."""
        self.free(self.malloc(nbytes))

    def run(self, ops: Iterable[tuple[int, int]], stream: int = 0) -> dict[int, int]:
        """Replay requests on ``stream``: ``(ALLOC, bytes)``, ``(FREE, i)`` (the block the ``i``-th op
        allocated) or ``(FREE_ADDR, addr)``; returns the blocks still allocated by op index."""
        free, by_addr = self._free, self._by_addr
        bisect_left, insort = bisect.bisect_left, bisect.insort
        handles: dict[int, int] = {}
        pop = handles.pop
        allocated, peak = self.allocated_bytes, self.peak_allocated_bytes
        for i, (kind, value) in enumerate(ops):
            if kind == ALLOC:
                need = MIN_BLOCK if value < MIN_BLOCK else MIN_BLOCK * ((value + MIN_BLOCK - 1) // MIN_BLOCK)
                small = need <= SMALL_SIZE
                j = bisect_left(free, (small, stream, need, -1))
                if j < len(free) and free[j][0] == small and free[j][1] == stream:  # best fit: the smallest block
                    block = by_addr[free.pop(j)[3]]
                else:
                    block = (self._grow(small, stream, need) if self.expandable
                             else self._new_segment(small, stream, segment_size(need)))
                remaining = block.size - need
                if remaining >= MIN_BLOCK if small else remaining > SMALL_SIZE:
                    nxt = block.next
                    rest = _Block(block.addr + need, remaining, small, stream, True, block, nxt)
                    if nxt is not None:
                        nxt.prev = rest
                    block.next = rest
                    block.size = need
                    by_addr[rest.addr] = rest
                    insort(free, (small, stream, remaining, rest.addr))
                block.free = False
                allocated += block.size
                peak = max(peak, allocated)
                handles[i] = block.addr
                continue
            block = by_addr[pop(value) if kind == FREE else value]
            if block.free:
                self.allocated_bytes, self.peak_allocated_bytes = allocated, peak
                raise ValueError(f"double free of the block at {block.addr}")
            allocated -= block.size
            block.free = True
            for neighbour in (block.prev, block.next):
                if neighbour is not None and neighbour.free:
                    del free[bisect_left(free, (neighbour.small, neighbour.stream, neighbour.size, neighbour.addr))]
                    low, high = (block, neighbour) if block.addr < neighbour.addr else (neighbour, block)
                    low.size += high.size
                    low.next = high.next
                    if high.next is not None:
                        high.next.prev = low
                    del by_addr[high.addr]
                    by_addr[low.addr] = low
                    block = low
            insort(free, (block.small, block.stream, block.size, block.addr))
        self.allocated_bytes, self.peak_allocated_bytes = allocated, peak
        return handles

    def _grow(self, small: bool, stream: int, need: int) -> _Block:
        """Map what ``need`` lacks at the end of the (small, stream) segment; returns the block
        (taken from the free list) that now holds at least ``need`` bytes."""
        step = SMALL_BUFFER if small else LARGE_BUFFER
        index, last = self._grown.get((small, stream), (len(self.segments), None))
        while last is not None and last.next is not None:
            last = last.next
        if last is not None and last.free:  # the free end of the range grows
            del self._free[bisect.bisect_left(self._free, (small, stream, last.size, last.addr))]
            extra = step * ((need - last.size + step - 1) // step)
            last.size += extra
            block = last
        else:
            extra = step * ((need + step - 1) // step)
            base = self._next_addr if last is None else last.addr + last.size
            block = _Block(base, extra, small, stream, True, last, None)
            if last is None:  # a new segment, in a virtual range no schedule fills
                self.segments.append(0)
                self._next_addr += 1 << 48
                self._grown[small, stream] = (index, block)
            else:
                last.next = block
            self._by_addr[base] = block
        self.segments[index] += extra
        block.free = False
        return block

    def _new_segment(self, small: bool, stream: int, size: int) -> _Block:
        # below every segment before it, as cudaMalloc hands them out: equal free blocks go to the
        # newest segment first (``ascending``: the oldest); never adjacent, so nothing merges
        if self.order_seed is not None:  # far apart, at random: only their order matters
            self._rng = self._rng or random.Random(self.order_seed)
            addr = self._rng.randrange(1 << 24) << 32
            while addr in self._by_addr:
                addr = self._rng.randrange(1 << 24) << 32
        elif self.ascending:
            addr = self._next_addr
            self._next_addr += size + ROUND_LARGE
        else:
            self._next_segment -= size + ROUND_LARGE
            addr = self._next_segment
        self.segments.append(size)
        block = _Block(addr, size, small, stream, False)
        self._by_addr[addr] = block
        return block
