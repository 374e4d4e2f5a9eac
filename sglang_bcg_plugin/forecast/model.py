"""The graph memory of a schedule, per output mode: every size of a :class:`~.trace.ScaledTrace`
captured largest first into one :class:`~.allocator.PoolModel` (docs/forecast.md)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from .allocator import LARGE_BUFFER, MB, ROUND_LARGE, SMALL_SIZE, PoolModel, round_size, segment_size
from .driver import DriverShare
from .trace import ScaledTrace

MODES = ("off", "on", "released")


@dataclass(frozen=True, slots=True)
class ModeForecast:
    """The forecast graph memory of one output mode, in parts (bytes; docs/forecast.md describes
    each): ``total_bytes`` is their sum, the free device memory the capture session loses."""

    mode: str
    total_bytes: int
    working_set_bytes: int
    outputs_bytes: int
    stream_bytes: int = 0
    bridge_bytes: int = 0
    keeps_largest: bool = False
    driver_bytes: int = 0
    probe_left_bytes: int = 0
    address_bytes: int = 0

    @property
    def allocator_bytes(self) -> int:
        """The total without the driver's share and what the probes left."""
        return self.total_bytes - self.driver_bytes - self.probe_left_bytes

    @property
    def pool_bytes(self) -> int:
        """The graph pool plus a shared buffer (what SGLang's pool holds)."""
        return self.working_set_bytes + self.outputs_bytes + self.address_bytes

    def to_dict(self) -> dict[str, int | str | bool]:
        return {**asdict(self), "allocator_bytes": self.allocator_bytes}


def simulate(trace: ScaledTrace, sizes: Iterable[int], *, keep_outputs: str, outputs: frozenset[int],
             reserve_bytes: int = 0, expandable: bool = False, ascending: bool = False,
             order: int | None = None) -> PoolModel:
    """Capture every size (largest first) into one modelled pool starting with a free block of ``reserve_bytes``; the
    ``outputs`` allocs are freed after each capture unless ``keep_outputs`` is ``"all"`` or ``"first"`` (the largest
    kept); ``ascending``, ``order``: the segments' address order (:class:`PoolModel`)."""
    pool = PoolModel(expandable=expandable, ascending=ascending, order_seed=order)
    if reserve_bytes:
        pool.reserve(reserve_bytes)
    for rank, size in enumerate(sorted(set(sizes), reverse=True)):
        handles = pool.run(trace.at(size).ops)
        if keep_outputs == "none" or (keep_outputs == "first" and rank > 0):
            for i in trace.outputs_at(size, outputs):
                if i in handles:
                    pool.free(handles.pop(i))
    return pool


#: Seeded address orders tried where the pool depends on its segments' addresses.
ADDRESS_ORDERS = 32


def address_spread(trace: ScaledTrace, sizes: Iterable[int], *, outputs: frozenset[int],
                   reserve_bytes: int = 0) -> tuple[int, int, int]:
    """The ``released`` pool (starting with a free block of ``reserve_bytes``) in the model's order, and the lowest and
    highest over that order, the reverse and, where those two differ, :data:`ADDRESS_ORDERS` seeded ones."""
    sizes = list(sizes)

    def pool(**order: Any) -> int:
        return simulate(trace, sizes, keep_outputs="none", outputs=outputs, reserve_bytes=reserve_bytes,
                        **order).reserved_bytes

    modelled, reverse = pool(), pool(ascending=True)
    if modelled == reverse:
        return modelled, modelled, modelled
    pools = [modelled, reverse, *(pool(order=seed) for seed in range(ADDRESS_ORDERS))]
    return modelled, min(pools), max(pools)


def count_highest_order(modes: Mapping[str, ModeForecast], spread: tuple[int, int, int]) -> dict[str, ModeForecast]:
    """``modes`` with every mode's pool at the highest order of ``spread`` (:func:`address_spread`):
    the margin over the model's order is each mode's ``address_bytes``, in its total."""
    modelled, _, high = spread
    margin = high - modelled
    return {m: replace(f, total_bytes=f.total_bytes + margin, address_bytes=f.address_bytes + margin) if margin else f
            for m, f in modes.items()}


def address_caveat(spread: tuple[int, int, int], remedy: str = "") -> str:
    """The caveat where :func:`address_spread` found the orders apart (``remedy`` appended)."""
    modelled, low, high = spread
    if low == high:
        return ""
    return (f"this schedule's graph pool depends on the addresses cudaMalloc gives its segments (released: "
            f"{modelled / MB:.1f} MiB in the model's order, {low / MB:.1f} to {high / MB:.1f} MiB over "
            f"{ADDRESS_ORDERS + 2} address orders); the forecast counts the highest, so a process may take up to "
            f"{(high - low) / MB:.1f} MiB less" + (f"; {remedy}" if remedy else ""))


def buffer_bytes(largest_output_bytes: int, expandable: bool = False) -> int:
    """What a reserved shared buffer takes: above 1 MiB, a segment of its own."""
    need = round_size(largest_output_bytes) if largest_output_bytes else 0
    if need <= SMALL_SIZE:
        return need
    return LARGE_BUFFER * -(-need // LARGE_BUFFER) if expandable else segment_size(need)


#: Sizes tried for the pool's first block, in MiB above the largest capture's peak (rounded to
#: 2 MiB): each on the two largest captures, the best then on the whole schedule.
RESERVE_STEPS_MIB = (0, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)


def best_reserve(trace: ScaledTrace, sizes: list[int], *, keep_outputs: str, outputs: frozenset[int],
                 baseline: int) -> int:
    """The first block (bytes) that makes the schedule's pool smaller than ``baseline``, or 0 when
    none of :data:`RESERVE_STEPS_MIB` does (searched on the two largest captures)."""
    order = sorted(set(sizes), reverse=True)
    peak = simulate(trace, order[:1], keep_outputs=keep_outputs, outputs=outputs).peak_allocated_bytes
    start = -(-peak // ROUND_LARGE) * ROUND_LARGE
    candidate = min((simulate(trace, order[:2], keep_outputs=keep_outputs, outputs=outputs, reserve_bytes=block)
                     .reserved_bytes, block) for block in (start + step * MB for step in RESERVE_STEPS_MIB))[1]
    whole = simulate(trace, order, keep_outputs=keep_outputs, outputs=outputs, reserve_bytes=candidate)
    return candidate if whole.reserved_bytes < baseline else 0


def forecast_modes(trace: ScaledTrace, sizes: Iterable[int], **options: Any) -> dict[str, ModeForecast]:
    """:class:`ModeForecast` per mode for ``sizes``: the first part of :func:`schedule_forecast`,
    with the same keyword ``options`` (``outputs`` and ``largest_output_bytes`` required)."""
    return schedule_forecast(trace, sizes, **options)[0]


def schedule_forecast(trace: ScaledTrace, sizes: Iterable[int], *, outputs: frozenset[int], largest_output_bytes: int,
                      stream_bytes: int = 0, bridge_bytes: int = 0, source: str = "reserve",
                      pool_reserve: str | int = "off", configured_mode: str = "released", expandable: bool = False,
                      released_keeps: str = "none", driver: DriverShare | None = None, probe_left_bytes: int = 0,
                      ) -> tuple[dict[str, ModeForecast], dict[str, int], str, int]:
    """:func:`forecast_modes`, with ``on``'s pool plus buffer per source (``reserve``: the largest output outside the
    pool; ``adopt``: the largest capture's output kept in the pool as the buffer), the source taken (``"auto"``: the
    cheaper, ``reserve`` on a tie) and the pool's first block (``pool_reserve``: ``"off"``, bytes, or ``"auto"``:
    :func:`best_reserve`); ``released_keeps="auto"`` keeps the largest output where the pool is smaller.

    :raises ValueError: ``released_keeps`` is neither ``"none"`` nor ``"auto"``."""
    if released_keeps not in ("none", "auto"):
        raise ValueError(f"released_keeps must be 'none' or 'auto', got {released_keeps!r}")
    sizes = list(sizes)

    def pools(reserve_bytes: int) -> tuple[int, int, dict[str, int], str, bool]:
        """The pools released and kept, ``on``'s by source, the source taken, whether released keeps the largest."""
        released, kept, adopt = (simulate(trace, sizes, keep_outputs=keep, outputs=outputs, expandable=expandable,
                                          reserve_bytes=reserve_bytes).reserved_bytes
                                 for keep in ("none", "all", "first"))
        by_source = {"adopt": adopt, "reserve": released + buffer_bytes(largest_output_bytes, expandable)}
        chosen = ("adopt" if adopt < by_source["reserve"] else "reserve") if source == "auto" else source
        return released, kept, by_source, chosen, released_keeps == "auto" and by_source["adopt"] < released

    released, kept, by_source, chosen, keep_largest = pools(0)
    reserve_bytes = pool_reserve if isinstance(pool_reserve, int) else 0
    if pool_reserve == "auto" and not expandable:
        keep = {"off": "all", "released": "first" if keep_largest else "none"}.get(
            configured_mode, "first" if chosen == "adopt" else "none")
        baseline = {"all": kept, "none": released, "first": by_source["adopt"]}[keep]
        reserve_bytes = best_reserve(trace, sizes, keep_outputs=keep, outputs=outputs, baseline=baseline)
    if reserve_bytes:
        released, kept, by_source, chosen, keep_largest = pools(reserve_bytes)
    extra = stream_bytes + bridge_bytes + probe_left_bytes
    pool = {"off": kept, "on": by_source[chosen], "released": by_source["adopt"] if keep_largest else released}
    drv = {m: driver.bytes_for(m) if driver is not None else 0 for m in MODES}
    modes = {m: ModeForecast(m, pool[m] + extra + drv[m], released, pool[m] - released, stream_bytes, bridge_bytes,
                             keeps_largest=m == "released" and keep_largest, driver_bytes=drv[m],
                             probe_left_bytes=probe_left_bytes) for m in MODES}
    return modes, by_source, chosen, reserve_bytes


#: vLLM's floor for the per-graph cost of its extrapolation (1 MiB, "driver overhead per graph").
VLLM_MIN_PER_GRAPH = 1 << 20
#: SGLang 0.5.23's reserve for prefill graphs: 8 MiB per capture size (``arg_groups/memory_hook.py``).
SGLANG_RESERVE_PER_SIZE = 8 << 20


def reference_estimates(mode_forecasts: dict[str, ModeForecast], trace: ScaledTrace, sizes: Iterable[int], *,
                        outputs: frozenset[int], expandable: bool = False,
                        driver: DriverShare | None = None) -> dict[str, dict[str, int]]:
    """Per mode, what vLLM's extrapolation (the first capture plus ``N - 1`` times the second's
    cost) and SGLang's fixed reserve would say of the same schedule."""
    order = sorted(set(sizes), reverse=True)
    n = len(order)
    out: dict[str, dict[str, int]] = {}
    for mode, f in mode_forecasts.items():
        keep = "all" if mode == "off" else "first" if f.keeps_largest else "none"
        first = simulate(trace, order[:1], keep_outputs=keep, outputs=outputs, expandable=expandable).reserved_bytes
        two = simulate(trace, order[:2], keep_outputs=keep, outputs=outputs, expandable=expandable).reserved_bytes
        outside = f.allocator_bytes - f.working_set_bytes - (f.outputs_bytes if keep != "none" else 0)
        driver_first, driver_next = driver.per_size_bytes(n, mode) if driver is not None else (0, 0)
        first_cost = first + (outside if mode != "off" else f.stream_bytes + f.bridge_bytes) + driver_first
        per_graph = max(two - first + driver_next, VLLM_MIN_PER_GRAPH)
        out[mode] = {"vllm_extrapolation": first_cost + (n - 1) * per_graph,
                     "sglang_fixed_reserve": n * SGLANG_RESERVE_PER_SIZE}
    return out
