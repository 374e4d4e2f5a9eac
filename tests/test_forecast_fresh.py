"""The forecast against what fresh processes lost on the H200, rebuilt offline from their probes.

``tests/data/forecast/h200_fresh_processes.json.gz`` holds, per process of
``tests/gpu/forecast_driver_check.py`` (one fresh process per model x backend x mode: the synthetic
decoder at 38 sizes, and the four transformers families of ``tests/gpu/forecast_families.py`` at 50
sizes up to 4096 tokens), the probes' pool events, the graphs and nodes the probes counted, the
probes' own stream cost, and the free device memory the process lost over forecast and capture.
Each test rebuilds the forecast from those as ``forecast_schedule`` does on the device.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from sglang_bcg_plugin.forecast import pool_trace
from sglang_bcg_plugin.forecast.driver import DRIVER_COEFFICIENTS, DriverShare
from sglang_bcg_plugin.forecast.model import address_caveat, address_spread, count_highest_order, schedule_forecast
from sglang_bcg_plugin.forecast.probe import fit_probes, output_allocs

DATA = Path(__file__).parent / "data" / "forecast" / "h200_fresh_processes.json.gz"
ROWS: list[dict[str, Any]] = json.loads(gzip.decompress(DATA.read_bytes()))["rows"]
#: rows still outside the bound, and why (docs/forecast.md, "Fresh processes, five model families")
POOL_ADDRESSES = ("the graph pool took the model's order (492 MiB) where the forecast counts the highest of its "
                  "address orders (+26 MiB: on Qwen2's schedules alone, which free block a request takes depends "
                  "on the addresses cudaMalloc gave the pool's segments); over, not under: the caveat says a process "
                  "may take up to 34 MiB less; another process of the same row lost the highest, 518 MiB")
#: the rows whose pool depends on the addresses (the caveat names them; the forecast counts the highest order)
ADDRESS_ROWS = ("qwen2/full/released", "qwen2/full/on", "qwen2/full/off", "qwen2/breakable/released",
                "qwen2/breakable/on", "qwen2/breakable/off", "qwen2/full/released/pow2", "qwen2/breakable/released/pow2")
KNOWN_MISSES = {"qwen2/breakable/on": POOL_ADDRESSES}


def swept(row: dict[str, Any]) -> bool:
    """Whether the row's forecast ran its eager forward at every size first (the driver share's
    ``launch_bytes``); rows before that lost ~6 MiB more in the session than forecast."""
    return "launch_bytes" in row["driver"]


def _name(row: dict[str, Any]) -> str:
    """model/backend/mode, then the schedule and the pool reserve where not the defaults."""
    extra = [row[k] for k, default in (("schedule", "prefill"), ("pool_reserve", "off")) if row.get(k, default) != default]
    return "/".join([row["model"], row["backend"], row["mode"], *extra])


def _traces(row: dict[str, Any]) -> list[Any]:
    """The probes' traces in the order they ran: the largest, the smallest, then any size probed
    because the smallest did not pair (``forecast_schedule``'s ``fit_probes``)."""
    p = row["probes"]
    segments = [tuple(s) for s in p["pool_segments"]]
    return [pool_trace(int(n), [{"action": a, "addr": addr, "size": size} for a, addr, size in events], segments)
            for n, events in p["probes"].items()]


def _fitted(row: dict[str, Any]) -> Any:
    p = row["probes"]
    traces = _traces(row)
    return fit_probes(traces, p.get("output_bytes") or [[p["largest_output_bytes"]]] * len(traces))


def _paid(row: dict[str, Any]) -> int:
    """What the forecast's first launches and probes left lost beyond the probes' stream, as
    ``forecast_schedule`` measures it."""
    return max(0, row["lasting_bytes"] - row["forecast"]["modes"][row["mode"]]["probe_left_bytes"])


def _rebuilt(row: dict[str, Any]) -> int:
    """The configured mode's total, rebuilt from the row's probes with today's model."""
    p = row["probes"]
    sizes = p["sizes"]
    large = _traces(row)[0]
    d = row["driver"]
    recorded = row["forecast"]["modes"][row["mode"]]
    driver = DriverShare(d["graphs"], d["nodes"], d["on_copy_nodes"], d["first_capture"], d["nodes_counted"],
                         launch_bytes=d.get("launch_bytes", 0), paid_bytes=_paid(row), sizes=row["num_sizes"])
    modes, _, _, reserve = schedule_forecast(
        _fitted(row), sizes, outputs=output_allocs(large, [p["largest_output_bytes"]]),
        largest_output_bytes=p["largest_output_bytes"], stream_bytes=recorded["stream_bytes"],
        source="auto", pool_reserve=row.get("pool_reserve", "off"), configured_mode=row["mode"],
        released_keeps="auto", driver=driver,
        probe_left_bytes=recorded["probe_left_bytes"])
    assert reserve == row["forecast"].get("pool_reserve_bytes", 0)
    return count_highest_order(modes, _spread(row))[row["mode"]].total_bytes


_SPREADS: dict[str, tuple[int, int, int]] = {}


def _spread(row: dict[str, Any]) -> tuple[int, int, int]:
    """The row's ``released`` pool over the address orders, as ``forecast_schedule`` reads it."""
    if _name(row) not in _SPREADS:
        _SPREADS[_name(row)] = _address_spread(row)
    return _SPREADS[_name(row)]


def _address_spread(row: dict[str, Any]) -> tuple[int, int, int]:
    p = row["probes"]
    return address_spread(_fitted(row), p["sizes"], outputs=output_allocs(_traces(row)[0], [p["largest_output_bytes"]]),
                          reserve_bytes=row["forecast"].get("pool_reserve_bytes", 0))


@pytest.mark.parametrize("row", ROWS, ids=_name)
def test_forecast_is_within_two_percent_of_what_a_fresh_process_lost(row: dict[str, Any]) -> None:
    """Within 2 % where the forecast ran its first launches; 2.5 % on the rows recorded before."""
    if _name(row) in KNOWN_MISSES:
        pytest.xfail(KNOWN_MISSES[_name(row)])
    error = (_rebuilt(row) - row["lost_bytes"]) / row["lost_bytes"]
    assert abs(error) <= (0.02 if swept(row) else 0.025), f"{_name(row)}: {error:+.1%}"


def test_the_first_launches_are_what_the_session_no_longer_loses() -> None:
    """Where the forecast ran every size first, the capture session lost what its graphs account
    for: within 4 MiB (two of the driver's 2 MiB steps) of its reserved growth plus the driver's
    per-graph and per-node cost. Before the sweep, 6 to 8.5 MiB more on every family's row."""
    checked = launched = 0
    for row in ROWS:
        if not swept(row) or "session_lost_bytes" not in row or _name(row) in KNOWN_MISSES:
            continue
        d = row["driver"]
        per_graph = DriverShare(d["graphs"], d["nodes"], d["on_copy_nodes"], first_capture=False, sizes=row["num_sizes"])
        beyond = row["session_lost_bytes"] - row["session_reserved_bytes"] - per_graph.bytes_for(row["mode"])
        assert abs(beyond) <= 4 * 2**20, (_name(row), beyond / 2**20)
        launched += d["launch_bytes"] > 0  # the first launches took driver memory (not at pow2's sizes)
        checked += 1
    assert checked >= 10 and launched >= 10


def test_the_per_size_coefficient_is_the_fit_of_the_sessions() -> None:
    """``DRIVER_COEFFICIENTS.per_size_bytes`` is the least-squares fit (through zero) of what each
    swept session lost beyond its reserved growth and its graphs' and nodes' share, against the
    sizes it captured: 13 (pow2), 50 (prefill) and 68 (decode) sizes, four families, three
    backends. With it every such session is within 4 MiB of the line; without it the decode
    sessions lost up to 6 MiB more and the pow2 ones up to 2.9 MiB less."""
    sizes, beyond = [], []
    for row in ROWS:
        if not swept(row) or "session_lost_bytes" not in row:
            continue
        d = row["driver"]
        line = DriverShare(d["graphs"], d["nodes"], d["on_copy_nodes"], first_capture=False).bytes_for(row["mode"])
        sizes.append(row["num_sizes"])
        beyond.append(row["session_lost_bytes"] - row["session_reserved_bytes"] - line)
    fit = sum(s * b for s, b in zip(sizes, beyond, strict=True)) / sum(s * s for s in sizes)
    assert len(sizes) >= 50 and {13, 50, 68} <= set(sizes)
    assert DRIVER_COEFFICIENTS.per_size_bytes == pytest.approx(fit, rel=0.05)
    assert max(abs(b - s * DRIVER_COEFFICIENTS.per_size_bytes) for s, b in zip(sizes, beyond, strict=True)) <= 4 * 2**20


def test_the_rebuilt_forecast_is_the_devices_where_the_model_did_not_change() -> None:
    """The offline rebuild is the device's pipeline: every row differs from the forecast the device
    recorded by what today's model changed alone. Rows recorded before the driver's once-paid
    bytes were measured differ by those in place of the first launches and the first-capture
    coefficient, rows recorded with another per-size coefficient by the difference, rows recorded
    before the forecast counted the highest address order by its margin; synthetic Full
    ``on`` also by the small shared buffer's segment (a 5.6 MiB buffer takes a 20 MiB segment)."""
    coefficient = DRIVER_COEFFICIENTS.first_capture_bytes
    for row in ROWS:
        d = row["driver"]
        once = d["paid_bytes"] if d.get("paid_bytes") is not None else (
            d.get("launch_bytes", 0) + (coefficient if d["first_capture"] else 0))
        expected = row["forecast_bytes"] + _paid(row) - once
        # today's per-size coefficient in place of the one the row was recorded with (none before it)
        recorded = d["coefficients"].get("per_size_bytes", 0) if "sizes" in d else 0
        expected += row["num_sizes"] * (DRIVER_COEFFICIENTS.per_size_bytes - recorded)
        # the highest address order's margin, for rows recorded before the forecast counted it
        spread = _spread(row)
        expected += spread[2] - spread[0] - row["forecast"]["modes"][row["mode"]].get("address_bytes", 0)
        if _name(row) == "synthetic/full/on":
            expected += 20 * 2**20 - row["probes"]["largest_output_bytes"]
        assert _rebuilt(row) == expected, _name(row)


def test_known_misses_still_miss() -> None:
    """The rows named in KNOWN_MISSES are outside the bound (remove them from it once fixed)."""
    for row in ROWS:
        if _name(row) in KNOWN_MISSES:
            assert abs(_rebuilt(row) - row["lost_bytes"]) / row["lost_bytes"] > (0.02 if swept(row) else 0.025), _name(row)


def test_the_forecast_counts_the_highest_address_order_and_says_so() -> None:
    """The caveat names the segments' addresses on every row whose pool depends on them (Qwen2's
    Full and Breakable rows without a first block on the prefill and pow2 schedules, and no other),
    with the range over its address orders; the forecast counts the highest, which is what every
    such process lost but one (within 2 %), and that one lost less (the model's order)."""
    warned = set()
    for row in ROWS:
        spread = _spread(row)
        if address_caveat(spread):
            warned.add(_name(row))
            low, high = (f"{b / 2**20:.1f}" for b in spread[1:])
            assert f"{low} to {high} MiB over 34 address orders" in address_caveat(spread)
            if row.get("schedule", "prefill") == "prefill":
                assert spread == (298 * 2**20, 290 * 2**20, 324 * 2**20)
            error = (_rebuilt(row) - row["lost_bytes"]) / row["lost_bytes"]
            assert error >= -0.02, (_name(row), error)  # never under
            assert abs(error) <= 0.02 or _name(row) in KNOWN_MISSES, (_name(row), error)
    assert warned == set(ADDRESS_ROWS), warned
    assert all(r["model"] == "qwen2" and r["backend"] != "piecewise" and r.get("pool_reserve", "off") == "off"
               for r in ROWS if _name(r) in warned), warned


SESSION = DATA.with_name("h200_qwen2_fresh_session.json.gz")


def _replay(events: list[list[Any]], pool: Any) -> Any:
    """Replay a session's pool requests (``a``: alloc, ``f``: free) through ``pool``; returns it."""
    from sglang_bcg_plugin.forecast.allocator import ALLOC

    live = {}
    for kind, addr, size in events:
        if kind == "a":
            live[addr] = pool.run(((ALLOC, size),))[0]
        elif kind == "f":
            pool.free(live.pop(addr))
    return pool


def test_qwen2s_miss_is_the_addresses_alone() -> None:
    """The Qwen2 Full session of a fresh process, its allocator events recorded with their
    addresses: replayed through the allocator model with each new segment at the address cudaMalloc
    gave it, the model takes the real pool to the byte (324 MiB, every block where the allocator put
    it); in the model's own order (new segments below) 298 MiB, above 290. The model is exact; the
    addresses are what no forecast knows."""
    from sglang_bcg_plugin.forecast.allocator import PoolModel, _Block

    rec = json.loads(gzip.decompress(SESSION.read_bytes()))
    real = sorted(n for _, n in rec["pool_segments"])
    order = iter([(addr, size) for kind, addr, size in rec["events"] if kind == "s"])
    placed: list[int] = []

    class AtTheRealAddresses(PoolModel):
        def _new_segment(self, small: bool, stream: int, size: int) -> _Block:
            addr, real_size = next(order)
            assert real_size == size
            self.segments.append(size)
            block = _Block(addr, size, small, stream, False)
            self._by_addr[addr] = block
            return block

        def run(self, ops: Any, stream: int = 0) -> dict[int, int]:
            handles = super().run(ops, stream)
            placed.extend(handles.values())
            return handles

    oracle = _replay(rec["events"], AtTheRealAddresses())
    assert sorted(oracle.segments) == real and sum(real) == 324 * 2**20
    assert placed == [addr for kind, addr, _ in rec["events"] if kind == "a"]  # every block where the allocator put it
    below, above = (sum(_replay(rec["events"], PoolModel(ascending=up)).segments) for up in (False, True))
    assert (below, above) == (298 * 2**20, 290 * 2**20)
