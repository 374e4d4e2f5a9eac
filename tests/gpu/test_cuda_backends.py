"""Full and Breakable backends on real CUDA graphs (run on the H200; skipped without CUDA)."""

from __future__ import annotations

from sglang_bcg_plugin.output.mode import mode_of_option

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

from sglang_bcg_plugin import BackendOptions, ShapeKey, create_backend, graph_break
from sglang_bcg_plugin.bench.sizes import prefill_capture_sizes
from sglang_bcg_plugin.output.trees import flatten

pytestmark = pytest.mark.cuda

SIZES = sorted(prefill_capture_sizes(1024), reverse=True)
H = 256


@graph_break(reads=("x",), writes=("out",))
def scaled_softmax(x: torch.Tensor, out: torch.Tensor, scale: float) -> None:
    """Eager break: reads an activation, writes an activation in place."""
    out.copy_(torch.softmax(x * scale, dim=-1))


@graph_break(reads=("x",))
def eager_gelu(x: torch.Tensor) -> torch.Tensor:
    """Eager break returning a freshly allocated tensor (bridged through the arena)."""
    return torch.nn.functional.gelu(x) + 1.0


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    hidden: torch.Tensor
    aux: dict[str, Any]


class Net:
    def __init__(self, breaks: bool) -> None:
        g = torch.Generator(device="cpu").manual_seed(0)
        self.w1 = torch.randn(H, H, generator=g).cuda() / H**0.5
        self.w2 = torch.randn(H, H, generator=g).cuda() / H**0.5
        self.breaks = breaks

    def body(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.w1
        out = torch.empty_like(h)
        if self.breaks:
            scaled_softmax(h, out, 0.5)
            h2 = eager_gelu(out @ self.w2)
        else:
            out.copy_(torch.softmax(h * 0.5, dim=-1))
            h2 = torch.nn.functional.gelu(out @ self.w2) + 1.0
        return h2 + x


def _assert_same(a: Any, b: Any) -> None:
    _, la = flatten(a)
    _, lb = flatten(b)
    assert len(la) == len(lb)
    for (path, ta), (_, tb) in zip(la, lb):
        assert ta.shape == tb.shape, path
        torch.testing.assert_close(ta, tb, rtol=1e-5, atol=1e-5, msg=path)


def _capture(backend: Any, fwd: Callable[[torch.Tensor], Any], inputs: dict[Any, torch.Tensor]) -> None:
    with backend.capture_session():
        for key, x in inputs.items():
            backend.capture_one(key, lambda x=x: fwd(x), capture_inputs=x)


def _check_all(backend: Any, fwd: Callable[[torch.Tensor], Any], inputs: dict[Any, torch.Tensor]) -> None:
    for x in inputs.values():
        x.copy_(torch.randn_like(x))
    for key, x in inputs.items():
        _assert_same(backend.replay(key), fwd(x))


def _storages(out: Any) -> set[int]:
    return {t.untyped_storage().data_ptr() for _, t in flatten(out)[1]}


@pytest.fixture(params=["breakable", "full"])
def name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=[False, True], ids=["share_off", "share_on"])
def share(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


def _backend(name: str, share: bool, **kw: Any) -> Any:
    return create_backend(name, options=BackendOptions(output_mode=mode_of_option(share), engine="cuda", **kw))


def test_replay_equals_eager_every_size(name: str, share: bool) -> None:
    net = Net(breaks=name == "breakable")
    backend = _backend(name, share)
    inputs = {ShapeKey(s): torch.randn(s, H, device="cuda") for s in SIZES}
    _capture(backend, net.body, inputs)
    _check_all(backend, net.body, inputs)
    report = backend.memory_report()
    assert not report.fallbacks
    largest = SIZES[0] * H * 4
    if share:
        assert report.resident_output_bytes == largest
        assert len(set.union(*(_storages(backend.replay(k)) for k in inputs))) == 1
    else:
        assert report.resident_output_bytes == report.logical_output_bytes
    if name == "breakable":
        assert {backend.num_segments(k) for k in inputs} == {3}  # two breaks -> three segments
    backend.cleanup()


def test_multi_leaf_dataclass_and_spec_rows(name: str, share: bool) -> None:
    net = Net(breaks=name == "breakable")

    def fwd(x: torch.Tensor) -> Out:
        h = net.body(x)
        return Out(logits=h[:, :16].repeat(4, 1), hidden=h, aux={"pooled": h.mean(0, keepdim=True), "none": None})

    backend = _backend(name, share)
    inputs = {ShapeKey(s): torch.randn(s, H, device="cuda") for s in SIZES[:12]}
    _capture(backend, fwd, inputs)
    _check_all(backend, fwd, inputs)
    for key in inputs:
        out = backend.replay(key)
        assert isinstance(out, Out) and out.logits.shape[0] == 4 * key.size and out.aux["none"] is None
    report = backend.memory_report()
    assert not report.fallbacks
    if share:
        big = SIZES[0]
        assert report.resident_output_bytes == (4 * big * 16 + big * H + H) * 4


def test_two_streams_alternate_without_aliasing(name: str, share: bool) -> None:
    net = Net(breaks=name == "breakable")
    backend = _backend(name, share)
    inputs = {ShapeKey(s, i): torch.randn(s, H, device="cuda") for i in (0, 1) for s in SIZES[:8]}
    with backend.capture_session():
        for i in (0, 1):
            for s in SIZES[:8]:
                key = ShapeKey(s, i)
                x = inputs[key]
                backend.capture_one(key, lambda x=x: net.body(x), capture_inputs=x)
    for x in inputs.values():
        x.copy_(torch.randn_like(x))
    s0 = set.union(*(_storages(backend.replay(ShapeKey(s, 0))) for s in SIZES[:8]))
    s1 = set.union(*(_storages(backend.replay(ShapeKey(s, 1))) for s in SIZES[:8]))
    assert not (s0 & s1)
    for s in SIZES[:8]:
        a = backend.replay(ShapeKey(s, 0))
        b = backend.replay(ShapeKey(s, 1))
        _assert_same(a, net.body(inputs[ShapeKey(s, 0)]))
        _assert_same(b, net.body(inputs[ShapeKey(s, 1)]))


def test_allocator_churn_then_replay(name: str, share: bool) -> None:
    net = Net(breaks=name == "breakable")
    backend = _backend(name, share)
    inputs = {ShapeKey(s): torch.randn(s, H, device="cuda") for s in SIZES}
    _capture(backend, net.body, inputs)
    g = torch.Generator(device="cpu").manual_seed(1)
    keep = []
    for i in range(400):
        n = int(torch.randint(1, 1 << 20, (1,), generator=g))
        t = torch.full((n,), float(i), device="cuda")
        if i % 3 == 0:
            keep.append(t)
    torch.cuda.synchronize()
    _check_all(backend, net.body, inputs)
    for i, t in enumerate(keep):
        assert float(t[0]) == float(3 * i)  # replays did not write into churned memory
    del keep
    torch.cuda.empty_cache()
    _check_all(backend, net.body, inputs)


def test_ascending_capture_never_wrong_on_cuda(name: str) -> None:
    net = Net(breaks=name == "breakable")
    backend = _backend(name, True)
    inputs = {ShapeKey(s): torch.randn(s, H, device="cuda") for s in sorted(SIZES[:6])}
    with pytest.warns(UserWarning, match="largest-first"):
        _capture(backend, net.body, inputs)
    _check_all(backend, net.body, inputs)


def test_strict_mismatch_leaves_backend_consistent(name: str) -> None:
    from sglang_bcg_plugin import OutputStructureError

    net = Net(breaks=name == "breakable")
    backend = _backend(name, True, strict_outputs=True)
    x16, x8 = torch.randn(64, H, device="cuda"), torch.randn(32, H, device="cuda")
    with backend.capture_session():
        backend.capture_one(ShapeKey(64), lambda: net.body(x16), capture_inputs=x16)
        with pytest.raises(OutputStructureError, match="dtype"):
            backend.capture_one(ShapeKey(32), lambda: net.body(x8).double(), capture_inputs=x8)
        assert not torch.cuda.is_current_stream_capturing()
        backend.capture_one(ShapeKey(32), lambda: net.body(x8), capture_inputs=x8)
    _check_all(backend, net.body, {ShapeKey(64): x16, ShapeKey(32): x8})


def test_forward_exception_rolls_back(name: str) -> None:
    net = Net(breaks=name == "breakable")
    backend = _backend(name, True)
    xs = {s: torch.randn(s, H, device="cuda") for s in (64, 32)}
    calls = {"n": 0}

    def flaky() -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 3:  # fails inside the capture, after two good warmups
            raise RuntimeError("boom")
        return net.body(xs[32])

    with backend.capture_session():
        backend.capture_one(ShapeKey(64), lambda: net.body(xs[64]), capture_inputs=xs[64])
        with pytest.raises(RuntimeError, match="boom"):
            backend.capture_one(ShapeKey(32), flaky)
        assert not torch.cuda.is_current_stream_capturing()
        assert not backend.can_run(ShapeKey(32))
        backend.capture_one(ShapeKey(32), lambda: net.body(xs[32]), capture_inputs=xs[32])
    _check_all(backend, net.body, {ShapeKey(64): xs[64], ShapeKey(32): xs[32]})
