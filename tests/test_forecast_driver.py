"""The CUDA driver's share of the forecast (``forecast/driver.py``): its coefficients against the
H200 recording of ``tests/gpu/driver_cost.py``, the share of a schedule from the probes' counts,
its place in every mode's total, the count of graphs and nodes at ``capture_end``, and the
memory report's comparison with what a fresh process loses."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import pytest
import torch

from sglang_bcg_plugin.forecast import driver
from sglang_bcg_plugin.forecast.driver import (
    DRIVER_COEFFICIENTS,
    DriverShare,
    ProbeCount,
    counting_captures,
    probe_driver_share,
    schedule_share,
)
from sglang_bcg_plugin.forecast.model import ModeForecast, schedule_forecast
from sglang_bcg_plugin.forecast.probe import GraphMemoryForecast, driver_caveat
from sglang_bcg_plugin.forecast.trace import KeyTrace, ScaledTrace
from sglang_bcg_plugin.output.report import MemoryReport

MIB = 1 << 20
RECORDING = Path(__file__).parent / "data" / "driver" / "h200_driver_cost.json"
#: Free device memory moves in 2 MiB steps; the model is held within two of them of every reading.
TOLERANCE = 4 * MIB


def _readings() -> list[tuple[str, int, int, float]]:
    """(shape, graphs, nodes per graph, driver MiB) of every reading in the recording."""
    data: dict[str, Any] = json.loads(RECORDING.read_text())
    return [(label, r["graphs"], shape["nodes"], r["driver_mib"]) for label, shape in data.items()
            for r in shape["rows"]]


def test_the_recording_covers_graphs_and_nodes() -> None:
    readings = _readings()
    assert len(readings) == 63
    assert {g for _, g, _, _ in readings} == {1, 2, 4, 8, 16, 32, 64, 128, 256}
    assert {n for _, _, n, _ in readings} == {1, 4, 16, 64, 256}


def test_the_coefficients_are_the_recordings_least_squares_fit() -> None:
    """Refit the recording (driver MiB = first + per graph × graphs + per node × nodes): the
    coefficients kept in ``DRIVER_COEFFICIENTS`` are that fit, rounded."""
    readings = _readings()
    x = np.array([[1.0, g, g * n] for _, g, n, _ in readings])
    y = np.array([mib for *_, mib in readings])
    (first, per_graph, per_node), *_ = np.linalg.lstsq(x, y, rcond=None)
    c = DRIVER_COEFFICIENTS
    assert c.first_capture_bytes / MIB == pytest.approx(first, abs=0.5)  # 68.8 MiB
    assert c.per_graph_bytes / MIB == pytest.approx(per_graph, rel=0.05)  # 0.104 MiB
    assert c.per_node_bytes / MIB == pytest.approx(per_node, rel=0.05)  # 2.49 KiB
    assert "H200" in c.measured_on and "2.11" in c.measured_on


@pytest.mark.parametrize(("label", "graphs", "nodes", "driver_mib"), _readings())
def test_the_forecast_holds_every_recorded_reading(label: str, graphs: int, nodes: int, driver_mib: float) -> None:
    """Each reading as a forecast: the probes counted ``graphs`` graphs of ``nodes`` nodes (one
    size per graph) in a fresh process; every mode's total less the allocator's part is the
    driver's share, within 4 MiB of what the process lost beyond the allocator (at most 3.3 MiB
    off on the recording, on ``add64`` at 32 graphs; root mean square 1.2 MiB)."""
    sizes = list(range(graphs + 1, 1, -1))[:graphs] if graphs > 1 else [2]
    # the recording captured bare graphs, without a backend's work per key (the per-size coefficient)
    bare = dataclasses.replace(DRIVER_COEFFICIENTS, per_size_bytes=0)
    share = schedule_share([ProbeCount(sizes[0], 1, nodes), ProbeCount(sizes[-1], 1, nodes)], sizes, first_capture=True,
                           coefficients=bare)
    assert (share.graphs, share.nodes) == (graphs, graphs * nodes)
    trace = ScaledTrace.fit(KeyTrace(sizes[0], ((0, 4096),)), KeyTrace(sizes[-1] - 1, ((0, 4096),)))
    modes, *_ = schedule_forecast(trace, sizes, outputs=frozenset(), largest_output_bytes=0, driver=share)
    for f in modes.values():  # what the total holds beyond the modelled pool: the driver's share
        beyond = f.total_bytes - f.pool_bytes - f.stream_bytes - f.bridge_bytes
        assert beyond == f.driver_bytes
        assert abs(beyond - driver_mib * MIB) <= TOLERANCE, (label, graphs, beyond / MIB, driver_mib)


def test_the_first_capture_cost_is_paid_once() -> None:
    c = DRIVER_COEFFICIENTS
    assert c.bytes_for(0, 0) == 69 * MIB and c.bytes_for(0, 0, first_capture=False) == 0
    assert c.bytes_for(256, 256 * 256, first_capture=False) == 256 * (106 << 10) + 65536 * 2560
    share = DriverShare(74, 74 * 50, on_copy_nodes=74)
    assert share.bytes_for("on") - share.bytes_for("off") == 74 * 2560 == share.bytes_for("on") - share.bytes_for("released")
    first, later = share.per_size_bytes(74, "off")
    assert first - later == 69 * MIB and later == round((106 << 10) + 50 * 2560)
    assert DriverShare(74, 74 * 50, first_capture=False).bytes_for("off") == share.bytes_for("off") - 69 * MIB
    assert share.to_dict()["coefficients"]["per_node_bytes"] == 2560


def test_the_schedule_share_follows_the_probes() -> None:
    """Each size's graphs and nodes on the line through the two probes; one probe: constant;
    an unread probe: graphs only; no graph seen: nothing per graph, no copy node."""
    probes = [ProbeCount(16384, 5, 100), ProbeCount(4, 5, 60)]
    share = schedule_share(probes, [16384, 8194, 4], on_copy_nodes_per_size=2)
    assert (share.graphs, share.nodes, share.on_copy_nodes, share.nodes_counted) == (15, 100 + 80 + 60, 6, True)
    one = schedule_share([ProbeCount(16384, 33, 900)], [16384, 4096, 4], first_capture=False)
    assert (one.graphs, one.nodes, one.first_capture) == (99, 2700, False)
    unread = schedule_share([ProbeCount(16384, 5, None), ProbeCount(4, 5, 60)], [16384, 4])
    assert (unread.graphs, unread.nodes, unread.nodes_counted) == (10, 0, False)
    assert "nodes not counted" in unread.describe() and "graphs, not their nodes" in driver_caveat(unread)
    none = schedule_share([ProbeCount(16384, 0, 0), ProbeCount(4, 0, 0)], [16384, 4], on_copy_nodes_per_size=1)
    assert (none.graphs, none.on_copy_nodes) == (0, 0) and "no CUDA graph capture" in driver_caveat(none)
    assert driver_caveat(share) == "" and driver_caveat(None) == ""


def test_the_first_capture_cost_counts_where_the_probes_paid_it() -> None:
    counts = (ProbeCount(16384, 1, 50), ProbeCount(4, 1, 50))
    fresh = probe_driver_share(counts, 72 * MIB, [16384, 4], 1)
    warm = probe_driver_share(counts, 2 * MIB, [16384, 4], 1)
    assert fresh.first_capture and not warm.first_capture
    assert fresh.bytes_for("off") - warm.bytes_for("off") == 69 * MIB
    assert fresh.on_copy_nodes == 2


def test_capture_end_counts_graphs_and_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ``torch.cuda.CUDAGraph.capture_end`` while counting: the nodes read just before the
    capture ends; empty graphs apart; a failed capture_end not counted; the method restored."""
    ended: list[object] = []
    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_end", lambda self: ended.append(self))
    before = torch.cuda.CUDAGraph.capture_end
    reads = iter([40, 0, None, 7, 3])
    monkeypatch.setattr(driver, "capture_nodes", lambda: next(reads))
    with counting_captures() as count:
        for g in ("a", "b", "c"):
            torch.cuda.CUDAGraph.capture_end(g)  # type: ignore[arg-type]
        mark = len(count)
        torch.cuda.CUDAGraph.capture_end("d")  # type: ignore[arg-type]
        assert ProbeCount.of(8, count[mark:]) == ProbeCount(8, 1, 7)
        assert ProbeCount.of(16, count) == ProbeCount(16, 3, None)  # one unread: nodes unknown

        def fail(self: Any) -> None:
            raise RuntimeError("capture invalidated")

        monkeypatch.setattr(driver, "capture_nodes", lambda: 3)
    assert ended == ["a", "b", "c", "d"]
    assert count == [40, 0, None, 7]  # three graphs (47 nodes read, one unread) and an empty one
    assert ProbeCount.of(0, [40, 0, 7]) == ProbeCount(0, 2, 47)
    assert torch.cuda.CUDAGraph.capture_end is before
    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_end", fail)
    with counting_captures() as count, pytest.raises(RuntimeError, match="invalidated"):
        torch.cuda.CUDAGraph.capture_end("e")  # type: ignore[arg-type]
    assert count == [] and torch.cuda.CUDAGraph.capture_end is fail


def test_capture_end_inherited_is_restored_as_inherited(monkeypatch: pytest.MonkeyPatch) -> None:
    class Graph(torch.cuda.CUDAGraph):  # type: ignore[misc]
        pass

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    with counting_captures():
        assert "capture_end" in Graph.__dict__
    assert "capture_end" not in Graph.__dict__


def test_nodes_are_unread_without_the_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a machine without libcuda (this one, CI) the nodes cannot be read: ``None``, with why."""
    api, why = driver.driver_api()
    if api is not None:  # pragma: no cover - a CUDA machine: tests/gpu checks the count
        pytest.skip("libcuda is here")
    assert why and driver.capture_nodes() is None


def _forecast(lasting: int = 0, driver_bytes: int = 0) -> GraphMemoryForecast:
    modes = {m: ModeForecast(m, 400 * MIB + driver_bytes, 400 * MIB, 0, driver_bytes=driver_bytes)
             for m in ("off", "on", "released")}
    return GraphMemoryForecast("full", (16, 8, 4), "released", MappingProxyType(modes), (16, 4), 0.5,
                               lasting_bytes=lasting, driver=DriverShare(3, 30))


def test_the_report_compares_the_total_with_what_the_process_lost() -> None:
    """After a forecast in a fresh process, its probes left the driver's first-capture cost
    behind: the session's own drop misses it, the process's loss since before the forecast has it."""
    report = dataclasses.replace(MemoryReport.from_keys("full", "cuda", []), forecast=_forecast(72 * MIB, 75 * MIB),
                                 measured_graph_bytes=405 * MIB)
    assert report.lost_bytes == 477 * MIB
    assert report.forecast_error == pytest.approx((475 - 477) / 477)
    assert report.allocator_error == pytest.approx((400 - 405) / 405)
    d = report.to_dict()
    assert d["lost_bytes"] == 477 * MIB and d["allocator_error"] == pytest.approx(-5 / 405)
    assert d["forecast"]["modes"]["released"]["driver_bytes"] == 75 * MIB and d["forecast"]["lasting_bytes"] == 72 * MIB
    assert ("graph memory: forecast 475.0 MiB (released), lost 477.0 MiB since before the forecast, error -0.4 %; "
            "the CUDA driver's share 75.0 MiB of it; without it 400.0 MiB against the session's own drop 405.0 MiB, "
            "error -1.2 %") in report.format()
    plain = dataclasses.replace(report, forecast=_forecast(), measured_graph_bytes=500 * MIB)
    assert "forecast 400.0 MiB (released), measured 500.0 MiB, error -20.0 %" in plain.format()
    assert dataclasses.replace(report, measured_graph_bytes=None).forecast_error is None


def test_the_forecast_prints_the_driver_share() -> None:
    fc = _forecast(0, 75 * MIB)
    text = fc.format()
    assert "+ driver 75.0" in text and "driver: 3 graphs, 30 nodes, with the first-capture cost" in text
    assert fc.bytes_for() - fc.bytes_for(driver=False) == 75 * MIB
    assert fc.to_dict()["driver"]["graphs"] == 3 and fc.to_dict()["probe_driver_bytes"] == 0


def test_the_bench_row_leaves_the_driver_out_and_carries_it_apart() -> None:
    """The bench measures after a warm-up paid the driver's share: its row compares the allocator's part."""
    from sglang_bcg_plugin.bench.runner import _forecast_fields

    fields = _forecast_fields(_forecast(0, 75 * MIB), 400 * MIB)
    assert fields["forecast_bytes"] == 400 * MIB and fields["forecast_error"] == 0.0
    assert fields["forecast_driver_bytes"] == 75 * MIB
