"""Piecewise backend on real CUDA graphs (run on the H200; skipped without CUDA).

Same checks as tests/test_piecewise.py, plus the graph-pool memory of the pieces with output
sharing off vs on (printed, and written to ``$SGLANG_BCG_GPU_RESULTS_DIR/piecewise_memory.json``
when that variable is set).
"""

from __future__ import annotations

from sglang_bcg_plugin.output.mode import mode_of_option

import gc
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

from sglang_bcg_plugin import BackendOptions, ShapeKey, create_backend
from sglang_bcg_plugin.backends.piecewise import PiecewiseBackend
from sglang_bcg_plugin.output.trees import flatten

from splitting_ops import OPS, mix, write_softmax  # tests/splitting_ops.py

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the H200 machine)"),
]

SIZES = [1024, 768, 512, 384, 256, 128, 64, 32, 16, 8, 4, 2, 1]  # largest first, 1 included
LAYERS = 4  # splitting calls: LAYERS -> LAYERS + 1 pieces


class Net(torch.nn.Module):
    """``layers`` layers, each ending in one splitting call; returns two leaves."""

    def __init__(self, hidden: int, layers: int = LAYERS) -> None:
        super().__init__()
        self.layers = layers
        g = torch.Generator(device="cpu").manual_seed(0)
        w = torch.randn(layers + 1, hidden, hidden, generator=g) / hidden**0.5
        self.register_buffer("w", w.cuda())

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> dict[str, torch.Tensor]:
        h = x
        for i in range(self.layers):
            h = h @ self.w[i] + pos[:, None]
            if i % 2 == 0:
                h = mix(h)
            else:
                out = torch.empty_like(h)
                write_softmax(h, out)
                h = out * 2.0 + h
        return {"out": torch.relu(h @ self.w[self.layers]), "res": h * 0.5}


class EdgeNet(torch.nn.Module):
    """Splitting calls first and last (empty first/last pieces); also returns its input."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        g = torch.Generator(device="cpu").manual_seed(7)
        self.register_buffer("w", (torch.randn(hidden, hidden, generator=g) / hidden**0.5).cuda())

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = mix(x)
        h = h @ self.w + pos[:, None]
        return mix(h), x


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(params=[False, True], ids=["share_off", "share_on"])
def share(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


def _backend(share: bool, ops: list[Any] = OPS) -> PiecewiseBackend:
    backend = create_backend("piecewise", options=BackendOptions(output_mode=mode_of_option(share), engine="cuda"), splitting_ops=ops)
    assert isinstance(backend, PiecewiseBackend)
    return backend


class Setup:
    def __init__(self, backend: PiecewiseBackend, model: torch.nn.Module, hidden: int, sizes: list[int] = SIZES) -> None:
        self.backend, self.model, self.sizes = backend, model, sizes
        self.fn = backend.compile(model)
        self.x = torch.randn(max(sizes), hidden, device="cuda")
        self.pos = torch.randn(max(sizes), device="cuda")

    def forward(self, size: int) -> Callable[[], Any]:
        x, pos = self.x[:size], self.pos[:size]
        return lambda: self.fn(x, pos)

    def capture(self, stream: int | None = None) -> None:
        with torch.no_grad(), self.backend.capture_session():
            for s in self.sizes:
                self.backend.capture_one(ShapeKey(s, stream), self.forward(s), capture_inputs=(self.x, self.pos))

    def refill(self) -> None:
        self.x.copy_(torch.randn_like(self.x))
        self.pos.copy_(torch.randn_like(self.pos))

    def expected(self, size: int) -> Any:
        with torch.no_grad():
            return self.model(self.x[:size].clone(), self.pos[:size].clone())


def _assert_same(got: Any, want: Any) -> None:
    _, g = flatten(got)
    _, w = flatten(want)
    assert [p for p, _ in g] == [p for p, _ in w]
    for (path, a), (_, b) in zip(g, w, strict=True):
        assert a.shape == b.shape, path
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=lambda m, path=path: f"{path}: {m}")


def _storages(out: Any) -> set[int]:
    return {t.untyped_storage().data_ptr() for _, t in flatten(out)[1]}


def test_pieces_replay_and_one_compilation(share: bool) -> None:
    before = counters["stats"]["unique_graphs"]
    setup = Setup(_backend(share), Net(256), 256)
    setup.capture()
    backend = setup.backend
    assert counters["stats"]["unique_graphs"] - before == 1
    assert backend.num_compilations == 1
    assert backend.split_summaries[0].num_pieces == LAYERS + 1
    assert {backend.num_segments(ShapeKey(s)) for s in SIZES} == {LAYERS + 1}
    assert backend.engine_name == "cuda"
    for _ in range(2):
        setup.refill()
        for s in [1, 1024, 64, 384, 2, 768, 4, 512, 8, 256, 16, 128, 32]:
            _assert_same(backend.replay(ShapeKey(s)), setup.expected(s))
    report = backend.memory_report()
    assert not report.fallbacks
    if share:
        assert report.resident_output_bytes == 2 * SIZES[0] * 256 * 4  # the largest key's two leaves
        assert len(set.union(*(_storages(backend.replay(ShapeKey(s))) for s in SIZES))) == 2
    else:
        assert report.resident_output_bytes == report.logical_output_bytes
        outs = {s: backend.replay(ShapeKey(s)) for s in SIZES}
        for s in SIZES:  # every key keeps its own output
            _assert_same(outs[s], setup.expected(s))
    backend.cleanup()


def test_splitting_calls_at_both_ends(share: bool) -> None:
    setup = Setup(_backend(share, [mix]), EdgeNet(256), 256, sizes=SIZES[:6])
    setup.capture()
    for s in setup.sizes:
        assert setup.backend.num_segments(ShapeKey(s)) == 3
    x_before = setup.x.clone()
    for s in setup.sizes:
        setup.backend.replay(ShapeKey(s))
    torch.testing.assert_close(setup.x, x_before)  # the returned input is copied, never adopted
    setup.refill()
    for s in setup.sizes:
        _assert_same(setup.backend.replay(ShapeKey(s)), setup.expected(s))


def test_two_streams_never_alias() -> None:
    setup = Setup(_backend(True), Net(256), 256, sizes=SIZES[:6])
    with torch.no_grad(), setup.backend.capture_session():
        for stream in (0, 1):
            for s in setup.sizes:
                setup.backend.capture_one(ShapeKey(s, stream), setup.forward(s), capture_inputs=(setup.x, setup.pos))
    s0 = set.union(*(_storages(setup.backend.replay(ShapeKey(s, 0))) for s in setup.sizes))
    s1 = set.union(*(_storages(setup.backend.replay(ShapeKey(s, 1))) for s in setup.sizes))
    assert not (s0 & s1)
    setup.refill()
    for s in setup.sizes:
        _assert_same(setup.backend.replay(ShapeKey(s, 0)), setup.expected(s))
        _assert_same(setup.backend.replay(ShapeKey(s, 1)), setup.expected(s))


def test_allocator_churn_then_replay(share: bool) -> None:
    """Bridges and piece outputs are held strongly: later allocations never re-carve them."""
    setup = Setup(_backend(share), Net(256), 256)
    setup.capture()
    g = torch.Generator(device="cpu").manual_seed(1)
    keep = []
    for i in range(300):
        n = int(torch.randint(1, 1 << 20, (1,), generator=g))
        t = torch.full((n,), float(i), device="cuda")
        if i % 3 == 0:
            keep.append(t)
    torch.cuda.synchronize()
    setup.refill()
    for s in SIZES:
        _assert_same(setup.backend.replay(ShapeKey(s)), setup.expected(s))
    torch.cuda.synchronize()
    for i, t in enumerate(keep):
        assert float(t[0]) == float(3 * i) and float(t[-1]) == float(3 * i)


def test_failed_capture_leaves_no_capture_open() -> None:
    setup = Setup(_backend(True), Net(256), 256, sizes=[64, 32])
    calls = {"n": 0}

    def flaky() -> Any:
        calls["n"] += 1
        out = setup.fn(setup.x[:32], setup.pos[:32])
        if calls["n"] == 3:  # the recorded forward (after two warmups), inside the last graph
            raise RuntimeError("boom")
        return out

    with torch.no_grad(), setup.backend.capture_session():
        setup.backend.capture_one(ShapeKey(64), setup.forward(64), capture_inputs=(setup.x, setup.pos))
        with pytest.raises(RuntimeError, match="boom"):
            setup.backend.capture_one(ShapeKey(32), flaky)
        assert not torch.cuda.is_current_stream_capturing()
        assert not setup.backend.can_run(ShapeKey(32))
        setup.backend.capture_one(ShapeKey(32), setup.forward(32), capture_inputs=(setup.x, setup.pos))
    setup.refill()
    for s in (64, 32):
        _assert_same(setup.backend.replay(ShapeKey(s)), setup.expected(s))


def _settle() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def test_graph_pool_memory_sharing_off_vs_on() -> None:
    """Device memory the captured pieces hold, sharing off vs on: the pool (reserved delta) always;
    the free device memory lost (mem_get_info delta) only when no other xdist worker shares the device."""
    hidden = 2048
    sizes = [2048, 1536, 1024, 768, 512, 384, 256, 128, 64, 32, 16, 8, 4, 2, 1]
    model = Net(hidden)
    results: dict[str, Any] = {"hidden": hidden, "layers": LAYERS, "sizes": sizes, "dtype": "float32"}
    with torch.no_grad():  # settle lazy CUDA/cuBLAS init outside the measurement
        model(torch.randn(8, hidden, device="cuda"), torch.randn(8, device="cuda"))
    for share in (False, True):
        torch._dynamo.reset()
        backend = _backend(share)
        setup = Setup(backend, model, hidden, sizes=sizes)
        _settle()
        free0, reserved0 = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()
        setup.capture()
        _settle()  # drop cached non-pool blocks (warmup intermediates); graph pools stay
        free1, reserved1 = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()
        setup.refill()
        for s in (sizes[0], sizes[-1], 384):
            _assert_same(backend.replay(ShapeKey(s)), setup.expected(s))
        report = backend.memory_report()
        results["share_on" if share else "share_off"] = {
            "graph_memory_bytes_mem_get_info": free0 - free1,
            "reserved_delta_bytes": reserved1 - reserved0,
            "resident_output_bytes": report.resident_output_bytes,
            "logical_output_bytes": report.logical_output_bytes,
            "bridge_arena_bytes": report.total_bridge_bytes,
            "pieces_per_key": backend.num_segments(ShapeKey(sizes[0])),
            "compilations": backend.num_compilations,
            "fallbacks": len(report.fallbacks),
        }
        backend.cleanup()
        del backend, setup
        _settle()
    off, on = results["share_off"], results["share_on"]
    mib = 1024 * 1024
    lines = [f"piecewise graph-pool memory (H={hidden}, {LAYERS} splitting calls, {len(sizes)} sizes up to {sizes[0]}, fp32)"]
    for name in ("share_off", "share_on"):
        r = results[name]
        lines.append(
            f"  {name}: mem_get_info delta {r['graph_memory_bytes_mem_get_info'] / mib:.1f} MiB, "
            f"reserved delta {r['reserved_delta_bytes'] / mib:.1f} MiB, resident outputs "
            f"{r['resident_output_bytes'] / mib:.1f} MiB of {r['logical_output_bytes'] / mib:.1f} MiB, "
            f"bridge arena {r['bridge_arena_bytes'] / mib:.1f} MiB"
        )
    print("\n".join(lines))
    out_dir = os.environ.get("SGLANG_BCG_GPU_RESULTS_DIR")
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "piecewise_memory.json").write_text(json.dumps(results, indent=2))
    assert off["compilations"] == on["compilations"] == 1
    assert off["fallbacks"] == on["fallbacks"] == 0
    assert on["resident_output_bytes"] == 2 * sizes[0] * hidden * 4
    assert off["resident_output_bytes"] == off["logical_output_bytes"]
    # sharing frees every non-largest key's output: ~2 x (sum(sizes) - max) x hidden x 4 bytes
    # Smaller keys' own outputs may fit in free pool blocks, so the pool need not grow (seen on
    # the H200: equal); it must never be larger with sharing on, and the held outputs shrink.
    assert on["reserved_delta_bytes"] <= off["reserved_delta_bytes"]
    # Free device memory is device-wide: beside other pytest-xdist workers it moves with theirs.
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) <= 1:
        assert on["graph_memory_bytes_mem_get_info"] <= off["graph_memory_bytes_mem_get_info"]
    assert on["resident_output_bytes"] < off["resident_output_bytes"]
