"""Piecewise backend on the eager engine (CPU): splitting, replay, sharing, one compilation."""

from __future__ import annotations

from sglang_bcg_plugin.output.mode import mode_of_option

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

from sglang_bcg_plugin import BackendOptions, ShapeKey, SharedOutputFallbackWarning, create_backend
from sglang_bcg_plugin.backends.piecewise import PiecewiseBackend
from sglang_bcg_plugin.backends.piecewise.ops import resolve_splitting_ops
from sglang_bcg_plugin.output.trees import flatten

from splitting_ops import OPS, mix, write_softmax  # tests/splitting_ops.py

H = 8
SIZES = [16, 8, 5, 2, 1]  # largest first; 1 included: it must not recompile


@torch.library.custom_op("sglang_bcg_test_pw::never_called", mutates_args=())
def never_called(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@never_called.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class Net(torch.nn.Module):
    """``k`` layers, each ending in one splitting call (alternating the two ops)."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k
        g = torch.Generator().manual_seed(k)
        self.register_buffer("w", torch.randn(k + 1, H, H, generator=g) / H**0.5)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> dict[str, torch.Tensor]:
        h = x
        for i in range(self.k):
            h = h @ self.w[i] + pos[:, None]
            if i % 2 == 0:
                h = mix(h)
            else:
                out = torch.empty_like(h)
                write_softmax(h, out)
                h = out * 2.0 + h
        return {"out": torch.relu(h @ self.w[self.k]), "res": h * 0.5}


class EdgeNet(torch.nn.Module):
    """Splitting calls first and last (empty first and last pieces); also returns its input."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("w", torch.randn(H, H, generator=torch.Generator().manual_seed(7)))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = mix(x)
        h = h @ self.w + pos[:, None]
        return mix(h), x


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    """Each test compiles afresh (dynamo caches per code object and stops at recompile_limit)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def make(share: bool, ops: list[Any] = OPS, **opts: Any) -> PiecewiseBackend:
    backend = create_backend(
        "piecewise", options=BackendOptions(engine="eager", output_mode=mode_of_option(share), **opts), splitting_ops=ops
    )
    assert isinstance(backend, PiecewiseBackend)
    return backend


class Setup:
    """A model, its compiled callable and static inputs sized for the largest key."""

    def __init__(
        self, backend: PiecewiseBackend, model: torch.nn.Module, sizes: list[int] = SIZES, dynamic: Any = "unbacked"
    ) -> None:
        self.backend, self.model, self.sizes = backend, model, sizes
        self.fn = backend.compile(model, dynamic=dynamic)
        self.x = torch.randn(max(sizes), H)
        self.pos = torch.randn(max(sizes))
        self.calls = 0

    def key(self, size: int, stream: int | None = None) -> ShapeKey:
        return ShapeKey(size, stream_idx=stream)

    def forward(self, size: int) -> Callable[[], Any]:
        x, pos = self.x[:size], self.pos[:size]

        def fwd() -> Any:
            self.calls += 1
            return self.fn(x, pos)

        return fwd

    def capture(self, sizes: list[int] | None = None, stream: int | None = None) -> None:
        with torch.no_grad(), self.backend.capture_session():
            for s in sizes or self.sizes:
                self.backend.capture_one(self.key(s, stream), self.forward(s), capture_inputs=(self.x, self.pos))

    def refill(self) -> None:
        self.x.copy_(torch.randn_like(self.x))
        self.pos.copy_(torch.randn_like(self.pos))

    def expected(self, size: int) -> Any:
        with torch.no_grad():
            return self.model(self.x[:size].clone(), self.pos[:size].clone())


def assert_same(got: Any, want: Any) -> None:
    _, g = flatten(got)
    _, w = flatten(want)
    assert [p for p, _ in g] == [p for p, _ in w]
    for (path, a), (_, b) in zip(g, w, strict=True):
        torch.testing.assert_close(a, b, msg=lambda m, path=path: f"{path}: {m}")


def clone(out: Any) -> Any:
    from sglang_bcg_plugin.output.trees import unflatten

    node, leaves = flatten(out)
    return unflatten(node, [t.clone() for _, t in leaves])


@pytest.mark.parametrize("k", [0, 1, 3])
def test_k_splitting_calls_give_k_plus_one_pieces(k: int) -> None:
    setup = Setup(make(False), Net(k), sizes=[4, 2])
    setup.capture()
    (summary,) = setup.backend.split_summaries
    assert summary.num_pieces == k + 1
    assert summary.num_splitting_calls == k
    for s in setup.sizes:
        assert setup.backend.num_segments(setup.key(s)) == k + 1
    assert {r.num_segments for r in setup.backend.memory_report().keys} == {k + 1}
    setup.refill()
    for s in setup.sizes:
        assert_same(setup.backend.replay(setup.key(s)), setup.expected(s))


@pytest.mark.parametrize("share", [False, True], ids=["share-off", "share-on"])
def test_replay_equals_eager_for_all_sizes_after_inputs_change(share: bool) -> None:
    setup = Setup(make(share), Net(3))
    hooks: list[int] = []
    with torch.no_grad(), setup.backend.capture_session():
        for s in setup.sizes:
            setup.backend.capture_one(
                setup.key(s), setup.forward(s), capture_inputs=(setup.x, setup.pos), post_warmup_hook=lambda s=s: hooks.append(s)
            )
    assert hooks == [s for s in setup.sizes for _ in range(2)]  # two warmups per key, in order
    calls_after_capture = setup.calls
    for _ in range(2):
        setup.refill()
        for s in [1, 16, 5, 8, 2]:  # not capture order
            assert_same(setup.backend.replay(setup.key(s)), setup.expected(s))
    assert setup.calls == calls_after_capture  # replay runs the recorded pieces, not the forward
    if not share:  # every key keeps its own output: all still valid after replaying the others
        outs = {s: setup.backend.replay(setup.key(s)) for s in setup.sizes}
        for s in setup.sizes:
            assert_same(outs[s], setup.expected(s))


@pytest.mark.parametrize(
    ("dynamic", "compilations"), [("auto", 1), ("unbacked", 1), ("size_oblivious", 1), ("backed", 2)]
)
def test_one_compilation_serves_every_size(dynamic: str, compilations: int) -> None:
    before = counters["stats"]["unique_graphs"]
    setup = Setup(make(True), Net(2), dynamic=dynamic)
    setup.capture()
    # "backed" lets dynamo specialize size 1: the documented reason it is not the default
    assert counters["stats"]["unique_graphs"] - before == compilations
    assert setup.backend.num_compilations == compilations
    setup.refill()
    for s in setup.sizes:
        assert_same(setup.backend.replay(setup.key(s)), setup.expected(s))


def test_unknown_dynamic_mode() -> None:
    with pytest.raises(ValueError, match="dynamic must be one of 'auto', 'unbacked', 'size_oblivious', 'backed', got 'yes'"):
        make(False).compile(Net(1), dynamic="yes")  # type: ignore[arg-type]


def test_auto_dynamic_is_unbacked_without_inductor() -> None:
    """Pieces run as traced need no size hint: ``"auto"`` keeps the one-compilation mode."""
    backend = make(False)
    assert backend.compile(Net(1)).dynamic == "unbacked"
    assert backend.compile(Net(1), dynamic="backed").dynamic == "backed"


def test_sharing_keeps_one_output_the_largest() -> None:
    reports = {}
    for share in (False, True):
        setup = Setup(make(share), Net(3))
        setup.capture()
        reports[share] = setup.backend.memory_report()
        largest = setup.backend.replay(setup.key(16))
        small = setup.backend.replay(setup.key(2))
        same = largest["out"].untyped_storage().data_ptr() == small["out"].untyped_storage().data_ptr()
        assert same is share
    off, on = reports[False], reports[True]
    out_bytes = {r.key.size: r.logical_output_bytes for r in on.keys}
    assert on.logical_output_bytes == off.logical_output_bytes == sum(out_bytes.values())
    assert off.resident_output_bytes == off.logical_output_bytes
    assert on.resident_output_bytes == out_bytes[16]
    assert not on.fallbacks
    assert all(r.shared for r in on.keys) and not any(r.shared for r in off.keys)


def test_unused_splitting_op_is_harmless() -> None:
    setup = Setup(make(True, [*OPS, never_called]), Net(3), sizes=[8, 4])
    setup.capture()
    assert setup.backend.split_summaries[0].num_pieces == 4
    setup.refill()
    for s in (4, 8):
        assert setup.backend.num_segments(setup.key(s)) == 4
        assert_same(setup.backend.replay(setup.key(s)), setup.expected(s))


@pytest.mark.parametrize("share", [False, True], ids=["share-off", "share-on"])
def test_splitting_calls_at_both_ends_and_input_in_output(share: bool) -> None:
    setup = Setup(make(share, [mix]), EdgeNet(), sizes=[8, 4, 1])
    setup.capture()
    x_before = setup.x.clone()
    outs = {s: setup.backend.replay(setup.key(s)) for s in setup.sizes}
    torch.testing.assert_close(setup.x, x_before)  # the returned input was never adopted/overwritten
    for s in setup.sizes:
        assert setup.backend.num_segments(setup.key(s)) == 3
        out = outs[s]
        # bridge slots and inputs are shared: the output owns copies of them
        assert out[1].untyped_storage().data_ptr() != setup.x.untyped_storage().data_ptr()
        if not share:
            assert_same(out, setup.expected(s))
    setup.refill()
    for s in setup.sizes:
        assert_same(setup.backend.replay(setup.key(s)), setup.expected(s))


def test_stream_partitions_never_share() -> None:
    setup = Setup(make(True), Net(1), sizes=[8, 4])
    with torch.no_grad(), setup.backend.capture_session():
        for stream in (0, 1):
            for s in setup.sizes:
                setup.backend.capture_one(setup.key(s, stream), setup.forward(s), capture_inputs=(setup.x, setup.pos))
    ptr = {
        (s, stream): setup.backend.replay(setup.key(s, stream))["out"].untyped_storage().data_ptr()
        for s in setup.sizes
        for stream in (0, 1)
    }
    assert ptr[(8, 0)] == ptr[(4, 0)] and ptr[(8, 1)] == ptr[(4, 1)] and ptr[(8, 0)] != ptr[(8, 1)]
    setup.refill()
    for stream in (0, 1):
        for s in setup.sizes:
            assert_same(setup.backend.replay(setup.key(s, stream)), setup.expected(s))


def test_capture_not_largest_first_falls_back_per_key() -> None:
    setup = Setup(make(True), Net(1), sizes=[4, 8])
    with pytest.warns(SharedOutputFallbackWarning, match="do not fit the buffer"):
        setup.capture()
    report = setup.backend.memory_report()
    assert list(report.fallbacks) == [setup.key(8)]
    setup.refill()
    for s in (8, 4):
        assert_same(setup.backend.replay(setup.key(s)), setup.expected(s))


@pytest.mark.parametrize("share", [False, True])
def test_work_outside_the_compiled_callable_is_replayed(share: bool) -> None:
    """Eager ops before (``fn(x * 2)``) and after (``fn(x) * 2``) the compiled callable are in
    the open segments, as a CUDA capture records them: replay is right after the inputs change."""
    backend = make(share)
    setup = Setup(backend, Net(1), sizes=[8, 4])
    with torch.no_grad(), backend.capture_session():
        for n in setup.sizes:
            x, pos = setup.x[:n], setup.pos[:n]
            backend.capture_one(
                setup.key(n),
                lambda x=x, pos=pos: {"out": setup.fn(x * 2, pos + 1)["out"] * 3, "x": x + 0},
                capture_inputs=(setup.x, setup.pos),
            )
    for _ in range(2):
        setup.refill()
        for n in setup.sizes:
            got = backend.replay(setup.key(n))
            with torch.no_grad():
                want = setup.model(setup.x[:n] * 2, setup.pos[:n] + 1)
            torch.testing.assert_close(got["out"], want["out"] * 3)
            torch.testing.assert_close(got["x"], setup.x[:n])


def test_a_forward_that_never_calls_the_compiled_callable_is_rejected() -> None:
    backend = make(False)
    setup = Setup(backend, Net(1), sizes=[4])
    x, pos = setup.x[:4], setup.pos[:4]
    with torch.no_grad(), backend.capture_session():
        with pytest.raises(RuntimeError, match="never called a callable compiled by this backend"):
            backend.capture_one(setup.key(4), lambda: setup.model(x, pos))
        assert not backend.can_run(setup.key(4))
        backend.capture_one(setup.key(4), setup.forward(4))  # the backend is still usable
    assert backend.can_run(setup.key(4))


def test_cleanup_releases_and_allows_recapture() -> None:
    setup = Setup(make(False), Net(1), sizes=[4])
    setup.capture()
    old = setup.backend.replay(setup.key(4))
    setup.backend.cleanup()
    assert not setup.backend.can_run(setup.key(4))
    setup.capture()
    assert setup.backend.num_compilations == 1  # the compiled callable is reused
    assert old is not setup.backend.replay(setup.key(4))


# -- splitting_ops validation -------------------------------------------------------------------
def test_packets_and_custom_ops_resolve_to_overloads() -> None:
    packet = torch.ops.sglang_bcg_test.mix
    assert resolve_splitting_ops([packet]) == (packet.default,)
    assert resolve_splitting_ops([mix, packet.default]) == (packet.default,)  # deduplicated
    assert resolve_splitting_ops(None) == ()
    assert make(False, []).splitting_ops == ()


@pytest.mark.parametrize(
    ("ops", "error", "match"),
    [
        (["sglang_bcg_test::mix"], TypeError, r"splitting_ops\[0\] = 'sglang_bcg_test::mix' \(str\).*strings"),
        ([mix, 3], TypeError, r"splitting_ops\[1\] = 3 \(int\) is not a torch op: expected"),
        ([torch.tanh], TypeError, r"splitting_ops\[0\].*builtin_function_or_method"),
        (torch.ops.sglang_bcg_test.mix.default, TypeError, "wrap a single op in a list"),
        ("sglang_bcg_test::mix", TypeError, "must be a list of torch op overloads"),
        (42, TypeError, "must be a list of torch op overloads"),
    ],
)
def test_bad_splitting_ops_are_named(ops: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        create_backend("piecewise", options=BackendOptions(engine="eager"), splitting_ops=ops)


def test_values_crossing_a_split_pass_as_they_are() -> None:
    """Zero-copy: no bridge storage, whatever the number of keys or layers."""
    for sizes in ([16], SIZES):
        setup = Setup(make(False), Net(3), sizes=sizes)
        setup.capture()
        assert setup.backend.memory_report().bridge_bytes == {}
        assert setup.backend.memory_report().total_bridge_bytes == 0


class SkipNet(torch.nn.Module):
    """Values living across splitting calls, views of a split's output, a value returned as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("w", torch.randn(3, H, H, generator=torch.Generator().manual_seed(3)) / H**0.5)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> dict[str, torch.Tensor]:
        r = torch.relu(x @ self.w[0]) + pos[:, None]  # read by the next two pieces
        early = r * 3.0  # returned as it is
        h = mix(r * 2.0)  # the argument dies here; the fresh output gets pool memory
        g = h @ self.w[1] + r
        half = h[:, : H // 2]  # a view of the split's output, read by the next piece
        out = torch.empty_like(g)
        write_softmax(g, out)
        y = out + r + half.sum(-1, keepdim=True)
        return {"y": y @ self.w[2], "early": early}


@pytest.mark.parametrize("share", [False, True], ids=["share-off", "share-on"])
def test_values_living_across_splitting_calls_replay_right(share: bool) -> None:
    setup = Setup(make(share), SkipNet())
    setup.capture()
    assert setup.backend.memory_report().total_bridge_bytes == 0
    for _ in range(2):
        setup.refill()
        for s in [1, 16, 5, 8, 2]:
            assert_same(setup.backend.replay(setup.key(s)), setup.expected(s))


@pytest.mark.parametrize("layers", [2, 4])
def test_decoder_replays_right_with_no_bridges(layers: int) -> None:
    from sglang_bcg_plugin.bench.model import DecoderConfig, SyntheticDecoder, attention_op

    torch._dynamo.reset()
    cfg = DecoderConfig(hidden=64, layers=layers, heads=4, kv_heads=2, intermediate=64, dtype=torch.float32, device="cpu")
    model = SyntheticDecoder(cfg, attention=attention_op)
    backend = make(True, [torch.ops.sglang_bcg_bench.attention.default])
    fn = backend.compile(model)
    x = torch.randn(16, cfg.hidden)
    with torch.no_grad(), backend.capture_session():
        for s in (16, 8, 1):
            backend.capture_one(ShapeKey(s), lambda s=s: fn(x[:s]), capture_inputs=x)
    assert backend.memory_report().total_bridge_bytes == 0
    assert backend.num_segments(ShapeKey(16)) == layers + 1
    x.copy_(torch.randn_like(x))
    for s in (1, 16, 8):
        with torch.no_grad():
            torch.testing.assert_close(backend.replay(ShapeKey(s)), model(x[:s].clone()))


def test_cuda_engine_requires_a_warmup() -> None:
    from sglang_bcg_plugin.engines.base import CaptureRequest
    from sglang_bcg_plugin.backends.piecewise.front import PieceFront
    from sglang_bcg_plugin.engines.cuda import SegmentCudaEngine

    request = CaptureRequest(ShapeKey(4), lambda: None, lambda o: o, 0, None, None)
    with pytest.raises(ValueError, match=r"needs num_warmups >= 1 \(got 0\)"):
        SegmentCudaEngine(PieceFront()).capture(request)  # raises before touching CUDA


def test_eager_engine_compiles_inside_the_recorded_run_without_warmups() -> None:
    setup = Setup(make(False, num_warmups=0), Net(1), sizes=[4, 2])
    setup.capture()
    setup.refill()
    for s in setup.sizes:
        assert_same(setup.backend.replay(setup.key(s)), setup.expected(s))


def test_cuda_engine_plumbing_with_fake_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA engine's control flow on CPU: one graph per piece, replayed in order.

    The graphs are fakes (no kernels are captured), so only the structure is checked here;
    tests/gpu/test_piecewise_gpu.py checks the values on a real GPU.
    """
    import contextlib

    import sglang_bcg_plugin.accounting as accounting

    log: list[str] = []

    class FakeGraph:
        def capture_begin(self, pool: object = None) -> None:
            log.append("begin")

        def capture_end(self) -> None:
            log.append("end")

        def replay(self) -> None:
            log.append("replay")

        def reset(self) -> None:
            log.append("reset")

    class FakeStream:
        def wait_stream(self, other: object) -> None:
            pass

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, 1))
    monkeypatch.setattr(PiecewiseBackend, "_use_cuda", lambda self: True)
    monkeypatch.setattr(accounting, "_reserved", lambda backend: None)
    setup = Setup(make(True), Net(3), sizes=[8, 4])
    setup.capture()
    assert setup.backend.engine_name == "cuda"
    assert log == ["begin", "end"] * 9  # the pool's anchor graph + 2 keys x 4 pieces
    log.clear()
    setup.backend.replay(setup.key(4))
    assert log == ["replay"] * 4
    setup.backend.cleanup()
    assert log[4:] == ["reset"] * 9  # 8 pieces, then the anchor


@pytest.mark.parametrize("share", [False, True], ids=["share-off", "share-on"])
def test_opaque_capture_inputs_are_protected(share: bool) -> None:
    """capture_inputs may be any object (SGLang passes a ForwardBatch): its tensors are found."""

    class Batch:
        def __init__(self, x: torch.Tensor, pos: torch.Tensor) -> None:
            self.input_ids, self.positions = x, pos

    setup = Setup(make(share, [mix]), EdgeNet(), sizes=[8, 4])
    with torch.no_grad(), setup.backend.capture_session():
        for s in setup.sizes:
            setup.backend.capture_one(setup.key(s), setup.forward(s), capture_inputs=Batch(setup.x, setup.pos))
    x_before = setup.x.clone()
    for s in setup.sizes:
        setup.backend.replay(setup.key(s))
    torch.testing.assert_close(setup.x, x_before)  # the returned input was never adopted
    setup.refill()
    for s in setup.sizes:
        assert_same(setup.backend.replay(setup.key(s)), setup.expected(s))


class CacheNet(torch.nn.Module):
    """A forward whose second argument is a fixed-size buffer (a cache) longer than every size."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("w", torch.randn(H, H, generator=torch.Generator().manual_seed(3)))

    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        return mix(x @ self.w + cache[: x.shape[0]])


def test_eager_forwards_in_the_size_context_keep_one_compilation() -> None:
    """The forecast runs each size eagerly in ``backend.size_context`` before any capture (its
    first launches): the compiled callable still marks the size's extent dynamic, not the longer
    cache's, so the captures after it need no recompile and replay right."""
    backend = make(True)
    model = CacheNet()
    fn = backend.compile(model, dynamic="unbacked")
    x, cache = torch.randn(max(SIZES), H), torch.randn(4 * max(SIZES), H)
    with torch.no_grad():
        for s in SIZES:
            with backend.size_context(s):
                fn(x[:s], cache)
        with backend.capture_session():
            for s in SIZES:
                backend.capture_one(ShapeKey(s), lambda s=s: fn(x[:s], cache), capture_inputs=(x, cache))
    assert backend.num_compilations == 1
    x.copy_(torch.randn_like(x))
    cache.copy_(torch.randn_like(cache))
    for s in SIZES:
        with torch.no_grad():
            assert_same(backend.replay(ShapeKey(s)), model(x[:s].clone(), cache.clone()))
