"""Two probe captures (a schedule's largest and smallest sizes, mode ``off``), their allocator
traces, and the forecast of every size per output mode built from them (CUDA only; docs/forecast.md)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from ..accounting import device_free_bytes
from ..engines.gcsafe import gc_safe_capture
from ..errors import CaptureStateError, ForecastError
from ..contract import BackendProtocol
from ..output.plan import BufferSource, ForecastAdvice
from ..shape_key import ShapeKey
from ..output.trees import flatten
from .allocator import MB, expandable_segments
from .driver import DriverShare, ProbeCount, counting_captures, driver_api, probe_driver_share
from .model import (MODES, ModeForecast, address_caveat, address_spread, count_highest_order, reference_estimates,
                    schedule_forecast)
from .trace import KeyTrace, ScaledTrace, output_allocs, pinned_slack, pool_trace


@dataclass(frozen=True)
class GraphMemoryForecast:
    """The forecast graph memory of one schedule (largest first), per output mode (:class:`~.model.ModeForecast`);
    ``mode``: the one the backend's next session resolves to. The other fields are described in docs/forecast.md
    (``probe_sizes``: the largest, the smallest, then any probed because those two did not pair; ``caveat``: "" where
    none is known; ``driver``: ``None`` where not modelled)."""

    backend: str
    sizes: tuple[int, ...]
    mode: str
    modes: MappingProxyType[str, ModeForecast] = field(default_factory=lambda: MappingProxyType({}))
    probe_sizes: tuple[int, ...] = (0, 0)
    seconds: float = 0.0
    buffer_source: str = "reserve"
    on_by_source: MappingProxyType[str, int] = field(default_factory=lambda: MappingProxyType({}))
    references: MappingProxyType[str, dict[str, int]] = field(default_factory=lambda: MappingProxyType({}))
    probe_seconds: float = 0.0
    pool_reserve_bytes: int = 0
    caveat: str = ""
    driver: DriverShare | None = None
    probe_driver_bytes: int = 0
    lasting_bytes: int = 0

    @property
    def released_keeps_largest(self) -> bool:
        """Whether a ``released`` session after this forecast keeps the largest output."""
        return "released" in self.modes and self.modes["released"].keeps_largest

    @property
    def advice(self) -> ForecastAdvice:
        """What this forecast steers in the next session's plan (:func:`~..output.plan.plan_session`)."""
        source: BufferSource = "adopt" if self.buffer_source == "adopt" else "reserve"
        return ForecastAdvice(source, int(self.pool_reserve_bytes), self.released_keeps_largest)

    def bytes_for(self, mode: str | None = None, *, driver: bool = True) -> int:
        """The forecast total of ``mode`` (default: :attr:`mode`); ``driver=False``: the allocator's only."""
        f = self.modes[mode or self.mode]
        return f.total_bytes if driver else f.allocator_bytes

    def frees_against(self, other: str) -> int:
        """Bytes the configured mode holds less than ``other`` (negative: more)."""
        return self.bytes_for(other) - self.bytes_for()

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "mode": self.mode, "num_sizes": len(self.sizes),
                "max_tokens": self.sizes[0] if self.sizes else 0, "probe_sizes": list(self.probe_sizes),
                "seconds": self.seconds, "probe_seconds": self.probe_seconds,
                "pool_reserve_bytes": self.pool_reserve_bytes, "buffer_source": self.buffer_source,
                "caveat": self.caveat, "driver": None if self.driver is None else self.driver.to_dict(),
                "probe_driver_bytes": self.probe_driver_bytes, "lasting_bytes": self.lasting_bytes,
                "on_by_source": dict(self.on_by_source), "references": {m: dict(r) for m, r in self.references.items()},
                "modes": {m: f.to_dict() for m, f in self.modes.items()}}

    def format(self) -> str:
        mib = self.pool_reserve_bytes / MB
        block = f"; the pool starts with one {mib:.0f} MiB block" if self.pool_reserve_bytes else ""
        lines = [f"{self.backend}: graph memory forecast for {len(self.sizes)} sizes up to "
                 f"{self.sizes[0] if self.sizes else 0} tokens (probes {_and(self.probe_sizes)}, "
                 f"{self.seconds:.1f} s; on with the {self.buffer_source} buffer{block}):"]
        for m in MODES:
            f = self.modes[m]
            optional = (("probes' stream", f.probe_left_bytes), ("address orders", f.address_bytes))
            lines.append(f"  {m:8} {f.total_bytes / MB:9.1f} MiB = working set {f.working_set_bytes / MB:.1f} "
                         f"+ outputs {f.outputs_bytes / MB:.1f} + stream {f.stream_bytes / MB:.1f} "
                         f"+ bridges {f.bridge_bytes / MB:.1f} + driver {f.driver_bytes / MB:.1f}"
                         + "".join(f" + {part} {n / MB:.1f}" for part, n in optional if n)
                         + (" (keeps the largest output: a tighter pool)" if f.keeps_largest else "")
                         + (" <- configured" if m == self.mode else ""))
        if self.driver is not None:
            lines.append(f"  driver: {self.driver.describe()} (the probes lost {self.probe_driver_bytes / MB:.1f} MiB "
                         "outside the allocator)")
        if self.caveat:
            lines.append(f"  caveat: {self.caveat}")
        return "\n".join(lines)


def _and(sizes: Sequence[int]) -> str:
    return ", ".join(map(str, sizes[:-1])) + f" and {sizes[-1]}" if len(sizes) > 1 else "".join(map(str, sizes))


def pool_segments() -> list[tuple[tuple[int, ...], int, int]]:
    """``(pool id, address, bytes)`` of every segment of a private pool (not the default one)."""
    segments = [(tuple(s.get("segment_pool_id", (0, 0))), int(s["address"]), int(s["total_size"]))
                for s in torch.cuda.memory._snapshot()["segments"]]
    return [seg for seg in segments if seg[0] != (0, 0)]


def device_trace() -> list[dict[str, Any]]:
    """The allocator's recorded events on the current device."""
    return torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]


def record_history(enabled: bool) -> None:
    """Start (every event, Python stacks) or stop recording the allocator's history."""
    if enabled:
        torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=1_000_000)
    else:
        torch.cuda.memory._record_memory_history(enabled=None)


def reserved_bytes() -> int:
    """Bytes PyTorch's caching allocator holds (read after ``empty_cache``)."""
    return int(torch.cuda.memory_reserved())


def _probe(backend: BackendProtocol, sizes: Sequence[int], forward_for: Callable[[int], Callable[[], Any]],
           capture_inputs: Any, upward: Sequence[int] = ()
           ) -> tuple[list[KeyTrace], list[list[int]], int, int, list[ProbeCount], int]:
    """Capture ``sizes`` (largest first), then, while the largest's and the last probe's traces
    cannot be paired (:func:`_fit`), the next of ``upward``: their pool traces, each one's output
    storage bytes, the bridge bytes, the stream's bytes (reserved outside the graph pool), the graphs
    each captured and the free device memory the session lost beyond the allocator's."""
    pools = {pool for pool, _, _ in pool_segments()}
    record_history(True)
    events: list[list[dict[str, Any]]] = []
    output_bytes: list[list[int]] = []
    queue, more = list(sizes), list(upward)

    def new_segments() -> list[tuple[int, int]]:
        return [(addr, nbytes) for pool, addr, nbytes in pool_segments() if pool not in pools]

    def traces() -> list[KeyTrace]:
        segments = new_segments()
        return [pool_trace(n, ev, segments) for n, ev in zip(queue, events, strict=True)]

    try:
        # No collection: free memory is measured inside the session (docs/index.md#gc-safety).
        with gc_safe_capture(collect=False), torch.no_grad(), backend.capture_session(), counting_captures() as count:
            free_before, reserved_before = device_free_bytes(collect=False), reserved_bytes()
            cursor = len(device_trace())
            counts = []
            for n in queue:  # the queue grows while the last probe does not pair with the largest
                before = len(count)
                out = backend.capture_one(ShapeKey(n), forward_for(n), capture_inputs=capture_inputs)
                counts.append(ProbeCount.of(n, count[before:]))
                trace = device_trace()
                events.append(trace[cursor:])
                cursor = len(trace)
                output_bytes.append([t.untyped_storage().nbytes() for _, t in flatten(out)[1]])
                if len(events) == len(queue) and more:
                    probed = traces()
                    if isinstance(_fit(probed[0], probed[-1]), ForecastError):
                        queue.append(more.pop(0))
            free_after, reserved_after = device_free_bytes(collect=False), reserved_bytes()
        segments = new_segments()
        bridges = backend.memory_report().total_bridge_bytes
    finally:
        record_history(False)
    slack = pinned_slack([e for ev in events for e in ev], segments)
    grown = reserved_after - reserved_before
    outside_pool = max(0, grown - sum(n for _, n in segments) - slack)
    return traces(), output_bytes, bridges, outside_pool, counts, max(0, free_before - free_after - grown)


def _fit(large: KeyTrace, small: KeyTrace) -> ScaledTrace | ForecastError:
    """:meth:`ScaledTrace.fit` of the two, or the error where their allocations cannot be paired."""
    try:
        with gc_safe_capture(collect=False):  # many short-lived objects (docs/index.md#gc-safety)
            return ScaledTrace.fit(large, small)
    except ForecastError as exc:
        return exc


def fit_probes(traces: Sequence[KeyTrace], output_bytes: Sequence[Sequence[int]]) -> ScaledTrace:
    """The lines through the first probe (the largest size) and the last one its allocations pair with;
    the probes between them, each a size whose forward allocates in another sequence, stand for their
    sizes alone (:attr:`ScaledTrace.alone`). :raises ForecastError: the largest pairs with none of the others."""
    for j in range(len(traces) - 1, 0, -1):  # the sizes probed because the smallest did not pair first
        fitted = _fit(traces[0], traces[j])
        if isinstance(fitted, ScaledTrace):
            break
    else:
        tried = ", ".join(str(t.size) for t in traces[2:])
        raise ForecastError(f"{fitted}" + (f" (nor at the next sizes up: {tried} tokens)" if tried else ""))
    alone = zip(traces[j + 1:], output_bytes[j + 1:], strict=True)
    return ScaledTrace(fitted.shape, fitted.lines, tuple((t, output_allocs(t, out)) for t, out in alone))


#: Sizes a forecast probes, the next up from the smallest, where the largest and smallest do not pair.
MAX_ALONE_PROBES = 3


def _checked_sizes(name: str, sizes: Iterable[int]) -> list[int]:
    """``sizes`` as a list of ints ``>= 1``, as ``ShapeKey`` takes them.
    :raises TypeError: not an iterable, or one is not an int. :raises ValueError: one is below 1."""
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Iterable):
        msg = f"{name} backend: forecast() takes the capture sizes as an iterable of ints, got {sizes!r:.200}"
        raise TypeError(msg)
    checked = list(sizes)
    head = f"{name} backend: forecast() sizes must be ints >= 1 (capture sizes, as ShapeKey.size), got"
    for s in checked:
        if isinstance(s, bool) or not isinstance(s, int):
            raise TypeError(f"{head} {s!r:.200} ({type(s).__name__}) in {checked!r:.200}")
        if s < 1:
            raise ValueError(f"{head} {s!r} in {checked!r:.200}")
    return checked


def forecast_schedule(backend: BackendProtocol, sizes: Iterable[int], forward_for: Callable[[int], Callable[[], Any]],
                      capture_inputs: Any = None, *, configured_mode: str) -> GraphMemoryForecast:
    """See :meth:`CaptureBackend.forecast`; ``configured_mode``: the mode its next session resolves to."""
    start = time.perf_counter()
    schedule = sorted(set(_checked_sizes(backend.name, sizes)), reverse=True)
    if len(schedule) < 2:
        raise ForecastError(f"{backend.name} backend: forecast() needs at least two sizes, got {schedule}")
    if backend.captured_keys():
        msg = f"{backend.name} backend: forecast() runs before the schedule is captured; cleanup() first"
        raise CaptureStateError(msg)
    if backend.engine_name != "cuda":
        raise ForecastError(f"{backend.name} backend: forecast() needs the CUDA engine (graph pools); this backend "
                            f"captures with the {backend.engine_name} engine")
    options = backend.options
    free_start, reserved_start = device_free_bytes(collect=False), reserved_bytes()  # both after empty_cache
    with gc_safe_capture(collect=False), torch.no_grad():  # the first launches: one eager forward per size
        for n in schedule:
            with backend.size_context(n):
                forward_for(n)()
    launch = max(0, free_start - device_free_bytes(collect=False) - (reserved_bytes() - reserved_start))
    # one warmup per probe (the pool sees only the capture); the probes' requests, the process's allocator
    backend.configure(output_mode="off", stale_output_guard=False, num_warmups=min(options.num_warmups, 1),
                      pool_reserve="off", pool_segments="fixed")
    try:
        traces, output_bytes, bridges, stream_bytes, counts, probe_driver = _probe(
            backend, (schedule[0], schedule[-1]), forward_for, capture_inputs,
            upward=schedule[-2:0:-1][:MAX_ALONE_PROBES])
    finally:
        backend.cleanup()
        backend.configure(**{f.name: getattr(options, f.name) for f in dataclasses.fields(options)})
    lasting = max(0, free_start - device_free_bytes(collect=False))
    probe_left = min(lasting, max(0, reserved_bytes() - reserved_start))  # what the forecast left reserved
    probe_seconds = time.perf_counter() - start
    largest_output = output_bytes[0]
    fitted = fit_probes(traces, output_bytes)
    with gc_safe_capture(collect=False):  # many short-lived objects (docs/index.md#gc-safety)
        outputs = output_allocs(traces[0], largest_output)
        expandable = expandable_segments() or options.pool_segments == "expandable"
        # the first launches and the probes' share with the driver, measured: the session pays its own graphs
        driver = dataclasses.replace(probe_driver_share(counts, probe_driver, schedule, len(largest_output)),
                                     launch_bytes=launch, paid_bytes=max(0, lasting - probe_left))
        modes, by_source, source, reserve_bytes = schedule_forecast(
            fitted, schedule, outputs=outputs, largest_output_bytes=sum(largest_output), stream_bytes=stream_bytes,
            bridge_bytes=bridges, source=options.shared_buffer, pool_reserve=options.pool_reserve,
            configured_mode=configured_mode, expandable=expandable, released_keeps="auto", driver=driver,
            probe_left_bytes=probe_left)
        remedy = "pool_reserve='auto' starts the pool as one block" if options.pool_reserve == "off" else ""
        modes, references, caveat = finish_modes(modes, fitted, schedule, outputs=outputs, expandable=expandable,
                                                 driver=driver, reserve_bytes=reserve_bytes, remedy=remedy)
    return GraphMemoryForecast(backend.name, tuple(schedule), configured_mode, MappingProxyType(modes),
                               tuple(t.size for t in traces), time.perf_counter() - start, source,
                               MappingProxyType(by_source), MappingProxyType(references), probe_seconds, reserve_bytes,
                               caveat, driver, probe_driver, lasting)


def finish_modes(modes: dict[str, ModeForecast], fitted: ScaledTrace, sizes: Sequence[int], *, outputs: frozenset[int],
                 expandable: bool, driver: DriverShare | None, reserve_bytes: int = 0, remedy: str = "",
                 counted: str = "during the probes") -> tuple[dict[str, ModeForecast], dict[str, dict[str, int]], str]:
    """``modes`` at the highest address order (:func:`~.model.count_highest_order`), their
    :func:`~.model.reference_estimates`, and the caveat (``""``: none; ``counted``: :func:`driver_caveat`'s)."""
    references = reference_estimates(modes, fitted, sizes, outputs=outputs, expandable=expandable, driver=driver)
    spread = (0, 0, 0) if expandable else address_spread(fitted, sizes, outputs=outputs, reserve_bytes=reserve_bytes)
    caveat = "; ".join(c for c in (EXPANDABLE_CAVEAT if expandable else "", driver_caveat(driver, counted),
                                   address_caveat(spread, remedy)) if c)
    return count_highest_order(modes, spread), references, caveat


def driver_caveat(driver: DriverShare | None, counted: str = "during the probes") -> str:
    """The caveat where the driver's share is partial (``counted``: where the captures were counted)."""
    if driver is None or (driver.graphs and driver.nodes_counted):
        return ""
    if driver.graphs == 0:
        return (f"no CUDA graph capture was seen {counted} (torch.cuda.CUDAGraph.capture_end): "
                "the driver's share holds no per-graph cost")
    why = driver_api()[1] or "the driver did not report the captures' nodes"
    return f"the driver's share counts graphs, not their nodes: {why}"


#: What :attr:`GraphMemoryForecast.caveat` says with ``expandable_segments`` on.
EXPANDABLE_CAVEAT = ("the graph pool grows with expandable_segments (the process's setting or "
                     "pool_segments='expandable'); the forecast models it as one segment growing in 20 MiB steps, "
                     "measured within 7 % on an H200 (up to 7 % over on Piecewise, within 3 % on Full), not exact "
                     "as without it")
