"""Output sharing on the eager engine (CUDA-graph static-output semantics on CPU)."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import pytest
import torch

from sglang_bcg_plugin import OutputStructureError, ShapeKey, SharedOutputFallbackWarning
from sglang_bcg_plugin.output.trees import flatten

from _support import Model, make_backend

SIZES = [64, 32, 16, 8, 4]


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    hidden: torch.Tensor | None
    extra: dict[str, Any]


class Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


def _capture_all(backend: Any, model: Model, forward: Any, sizes: list[int], stream_idx: int | None = None) -> dict[ShapeKey, Any]:
    fns = {}
    with backend.capture_session():
        for s in sizes:
            key = ShapeKey(s, stream_idx)
            x = model.input_for(key, s)
            fn = (lambda x=x: forward(x))
            fns[key] = fn
            backend.capture_one(key, fn, capture_inputs=x)
    return fns


def _assert_tree_equal(a: Any, b: Any) -> None:
    sa, la = flatten(a)
    sb, lb = flatten(b)
    assert len(la) == len(lb)
    for (pa, ta), (_, tb) in zip(la, lb):
        assert ta.shape == tb.shape, pa
        torch.testing.assert_close(ta, tb, rtol=0, atol=0, msg=pa)


def _storages(out: Any) -> set[int]:
    return {t.untyped_storage().data_ptr() for _, t in flatten(out)[1]}


def test_share_on_one_buffer_and_replay_equals_eager(backend_name: str) -> None:
    model = Model()
    forward = lambda x: x @ model.w  # noqa: E731
    backend = make_backend(backend_name, share=True)
    fns = _capture_all(backend, model, forward, SIZES)
    model.refill()
    outs = {}
    for key, fn in fns.items():
        out = backend.replay(key)
        _assert_tree_equal(out, fn())
        outs[key] = out
    assert len(set.union(*(_storages(o) for o in outs.values()))) == 1
    report = backend.memory_report()
    largest = 64 * model.hidden * 4
    assert report.resident_output_bytes == largest
    assert report.logical_output_bytes == sum(SIZES) * model.hidden * 4
    assert report.saved_bytes == report.logical_output_bytes - largest
    assert not report.fallbacks
    assert all(k.shared for k in report.keys)


def test_share_off_each_key_owns_output(backend_name: str) -> None:
    model = Model()
    backend = make_backend(backend_name, share=False)
    fns = _capture_all(backend, model, lambda x: x @ model.w, SIZES)
    model.refill()
    storages = [_storages(backend.replay(k)) for k in fns]
    assert len(set.union(*storages)) == len(SIZES)
    report = backend.memory_report()
    assert report.resident_output_bytes == report.logical_output_bytes
    assert report.saved_bytes == 0


def test_rows_come_from_output_not_key_size(backend_name: str) -> None:
    """Speculative-style forward: 4 x size rows (sglang #36749)."""
    model = Model()
    backend = make_backend(backend_name, share=True)
    fns = _capture_all(backend, model, lambda x: (x @ model.w).repeat(4, 1), SIZES)
    model.refill()
    for key, fn in fns.items():
        out = backend.replay(key)
        assert out.shape[0] == 4 * key.size
        torch.testing.assert_close(out, fn(), rtol=0, atol=0)
    assert backend.memory_report().resident_output_bytes == 4 * 64 * model.hidden * 4


def test_leaves_with_different_leading_dims_keep_own_capacity(backend_name: str) -> None:
    model = Model()

    def forward(x: torch.Tensor) -> Out:
        h = x @ model.w
        return Out(logits=h[:, :3].repeat(2, 1), hidden=h, extra={"pooled": h.sum(0, keepdim=True), "n": 7})

    backend = make_backend(backend_name, share=True)
    fns = _capture_all(backend, model, forward, SIZES)
    model.refill()
    for key, fn in fns.items():
        out = backend.replay(key)
        assert isinstance(out, Out) and out.extra["n"] == 7
        _assert_tree_equal(out, fn())
    report = backend.memory_report()
    assert not report.fallbacks
    # logits (128 rows x 3, a copy), hidden (64 x 8), pooled (1 x 8): the largest key's own leaves
    assert report.resident_output_bytes == (128 * 3 + 64 * 8 + 8) * 4


@pytest.mark.parametrize(
    "structure",
    ["tuple", "list", "dict", "namedtuple", "nested", "none_leaf", "holder"],
)
def test_structured_outputs(backend_name: str, structure: str) -> None:
    model = Model()

    class Holder:
        def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
            self.tensors = tensors

    def forward(x: torch.Tensor) -> Any:
        h = x @ model.w
        g = torch.tanh(h)
        return {
            "tuple": (h, g),
            "list": [h, g, None],
            "dict": {"h": h, "g": g},
            "namedtuple": Pair(h, g),
            "nested": ([h, {"g": (g, None)}], Out(h, None, {"k": [g]})),
            "none_leaf": (h, None, "label"),
            "holder": Holder({"hidden_states": h, "residual": g}),
        }[structure]

    backend = make_backend(backend_name, share=True)
    fns = _capture_all(backend, model, forward, SIZES)
    model.refill()
    for key, fn in fns.items():
        out = backend.replay(key)
        assert type(out) is type(fn())
        _assert_tree_equal(out, fn())
    report = backend.memory_report()
    assert not report.fallbacks
    assert report.resident_output_bytes < report.logical_output_bytes


def test_streams_never_share(backend_name: str) -> None:
    model = Model()
    backend = make_backend(backend_name, share=True)
    fwd = lambda x: x @ model.w  # noqa: E731
    fns0 = _capture_all(backend, model, fwd, SIZES, stream_idx=0)
    backend2_fns = {}
    with backend.capture_session():
        for s in SIZES:
            key = ShapeKey(s, 1)
            x = model.input_for(key, s)
            backend2_fns[key] = (lambda x=x: fwd(x))
            backend.capture_one(key, backend2_fns[key])
    s0 = set.union(*(_storages(backend.replay(k)) for k in fns0))
    s1 = set.union(*(_storages(backend.replay(k)) for k in backend2_fns))
    assert len(s0) == 1 and len(s1) == 1 and not (s0 & s1)
    # replay alternately: each stream's values stay its own
    model.refill()
    for s in SIZES:
        a = backend.replay(ShapeKey(s, 0)).clone()
        b = backend.replay(ShapeKey(s, 1))
        torch.testing.assert_close(a, fns0[ShapeKey(s, 0)](), rtol=0, atol=0)
        torch.testing.assert_close(b, backend2_fns[ShapeKey(s, 1)](), rtol=0, atol=0)


def test_same_stream_different_variant_shares(backend_name: str) -> None:
    model = Model()
    backend = make_backend(backend_name, share=True)
    with backend.capture_session():
        for label in ("a", "b"):
            for s in SIZES:
                key = ShapeKey(s, 0, label)
                x = model.input_for(key, s)
                backend.capture_one(key, lambda x=x: x @ model.w)
    assert backend.memory_report().resident_output_bytes == 64 * model.hidden * 4


MISFITS: dict[str, tuple[Any, Any, str]] = {
    # name: (output of largest key, output of the misfit key (as fn of h), expected reason fragment)
    "none_vs_tensor": (lambda h: (h, h), lambda h: (h, None), "expected a tensor, got None"),
    "tensor_vs_none": (lambda h: (h, None), lambda h: (h, h), "expected None, got a tensor"),
    "length": (lambda h: [h, h], lambda h: [h], "sequence length changed"),
    "keys": (lambda h: {"a": h}, lambda h: {"b": h}, "dict keys changed"),
    "type": (lambda h: (h,), lambda h: [h], "type changed"),
    "dtype": (lambda h: h, lambda h: h.double(), "dtype changed"),
    "bytes": (lambda h: h, lambda h: torch.cat([h, h, h], dim=1), "do not fit the buffer"),
    "leaf_value": (lambda h: (h, 1), lambda h: (h, 2), "non-tensor leaf value changed"),
}


#: Storage, not rows: outputs whose shape differs from the buffer's in any dim share as long
#: as they fit in its bytes (name: (largest key's output, smaller key's output)).
LAYOUTS: dict[str, tuple[Any, Any]] = {
    "trailing": (lambda h: h, lambda h: h[:, :4]),
    "zero_dim": (lambda h: (h, h.sum()), lambda h: (h, h.sum())),
    "batch_first": (lambda h: h.unsqueeze(0), lambda h: h.unsqueeze(0)),
    "size_on_dim_2": (lambda h: h.t().reshape(1, h.shape[1], -1), lambda h: h.t().reshape(1, h.shape[1], -1)),
    "rank_changed": (lambda h: h, lambda h: h.reshape(2, -1, h.shape[1])),
}


@pytest.mark.parametrize("case", sorted(LAYOUTS))
def test_any_layout_that_fits_shares(backend_name: str, case: str) -> None:
    big, small = LAYOUTS[case]
    model = Model()
    backend = make_backend(backend_name, share=True, strict_outputs=True)
    xs = {s: torch.randn(s, model.hidden) for s in (16, 8, 4)}
    fns = {ShapeKey(16): lambda: big(xs[16] @ model.w)}
    fns.update({ShapeKey(s): (lambda s=s: small(xs[s] @ model.w)) for s in (8, 4)})
    with backend.capture_session():
        for key, fn in fns.items():
            backend.capture_one(key, fn)
    report = backend.memory_report()
    assert not report.fallbacks and all(k.shared for k in report.keys)
    assert report.resident_output_bytes == report.keys[0].logical_output_bytes
    for x in xs.values():
        x.copy_(torch.randn_like(x))
    for key, fn in fns.items():
        out, ref = backend.replay(key), fn()
        _assert_tree_equal(out, ref)
        for o, r in zip(torch.utils._pytree.tree_leaves(out), torch.utils._pytree.tree_leaves(ref), strict=True):
            assert o.shape == r.shape and o.is_contiguous()


@pytest.mark.parametrize("case", sorted(MISFITS))
def test_misfit_falls_back_with_one_warning(backend_name: str, case: str) -> None:
    big, small, reason = MISFITS[case]
    model = Model()
    backend = make_backend(backend_name, share=True)
    xs = {s: torch.randn(s, model.hidden) for s in (16, 8, 4)}
    fns = {
        ShapeKey(16): lambda: big(xs[16] @ model.w),
        ShapeKey(8): lambda: small(xs[8] @ model.w),
        ShapeKey(4): lambda: big(xs[4] @ model.w),
    }
    with backend.capture_session():
        backend.capture_one(ShapeKey(16), fns[ShapeKey(16)])
        with pytest.warns(SharedOutputFallbackWarning) as record:
            backend.capture_one(ShapeKey(8), fns[ShapeKey(8)])
        backend.capture_one(ShapeKey(4), fns[ShapeKey(4)])
    assert len(record) == 1
    msg = str(record[0].message)
    assert "ShapeKey(size=8" in msg and reason in msg and "output" in msg
    report = backend.memory_report()
    assert list(report.fallbacks) == [ShapeKey(8)]
    assert reason in report.fallbacks[ShapeKey(8)]
    for x in xs.values():
        x.copy_(torch.randn_like(x))
    for key, fn in fns.items():
        _assert_tree_equal(backend.replay(key), fn())


@pytest.mark.parametrize("case", sorted(MISFITS))
def test_misfit_strict_raises(backend_name: str, case: str) -> None:
    big, small, reason = MISFITS[case]
    model = Model()
    backend = make_backend(backend_name, share=True, strict_outputs=True)
    x16, x8 = torch.randn(16, model.hidden), torch.randn(8, model.hidden)
    with backend.capture_session():
        backend.capture_one(ShapeKey(16), lambda: big(x16 @ model.w))
        with pytest.raises(OutputStructureError) as info:
            backend.capture_one(ShapeKey(8), lambda: small(x8 @ model.w))
    err = info.value
    assert isinstance(err, ValueError)
    assert err.shape_key == ShapeKey(8) and reason in err.reason and err.path.startswith("output")
    assert reason in str(err)
    assert not backend.can_run(ShapeKey(8)) and backend.can_run(ShapeKey(16))


def test_device_mismatch_falls_back(backend_name: str) -> None:
    """A leaf on another device than the buffer ('meta' stands in for a second device)."""
    model = Model()
    backend = make_backend(backend_name, share=True, strict_outputs=True)
    x = torch.randn(16, model.hidden)
    with backend.capture_session():
        backend.capture_one(ShapeKey(16), lambda: x @ model.w)
        with pytest.raises(OutputStructureError, match="device changed"):
            backend.capture_one(ShapeKey(8), lambda: torch.empty(8, model.hidden, device="meta"))


def test_ascending_capture_never_wrong(backend_name: str) -> None:
    model = Model()
    backend = make_backend(backend_name, share=True)
    fwd = lambda x: x @ model.w  # noqa: E731
    with pytest.warns(SharedOutputFallbackWarning, match="capture was not largest-first"):
        fns = _capture_all(backend, model, fwd, sorted(SIZES))
    model.refill()
    for key, fn in fns.items():
        torch.testing.assert_close(backend.replay(key), fn(), rtol=0, atol=0)
    report = backend.memory_report()
    assert set(report.fallbacks) == {ShapeKey(s) for s in SIZES[:-1]}


def test_output_aliasing_static_input_is_not_overwritten(backend_name: str) -> None:
    """A forward returning its static input must not turn that input into the shared buffer."""
    backend = make_backend(backend_name, share=True)
    xs = {s: torch.randn(s, 4) for s in (8, 4)}
    with backend.capture_session():
        for s in (8, 4):
            backend.capture_one(ShapeKey(s), lambda s=s: xs[s], capture_inputs=xs[s])
    before = xs[8].clone()
    backend.replay(ShapeKey(4))
    torch.testing.assert_close(xs[8], before, rtol=0, atol=0)
    torch.testing.assert_close(backend.replay(ShapeKey(4)), xs[4], rtol=0, atol=0)


def test_unsupported_output_type_is_a_clear_error(backend_name: str) -> None:
    class Opaque:
        def __init__(self, t: torch.Tensor) -> None:
            self.t = t

    backend = make_backend(backend_name, share=True)
    x = torch.randn(4, 4)
    with backend.capture_session(), pytest.raises(TypeError, match="unsupported output type"):
        backend.capture_one(ShapeKey(4), lambda: Opaque(x))
    assert not backend.can_run(ShapeKey(4))


def test_reserved_buffer_serves_every_key(backend_name: str) -> None:
    """``shared_buffer="reserve"``: the buffer is allocated from the last warmup's output before
    the first capture; every key, the first included, copies into it and hands out a view."""
    model = Model()
    backend = make_backend(backend_name, share=True, strict_outputs=True, shared_buffer="reserve")
    xs = {s: torch.randn(s, model.hidden) for s in SIZES}
    with backend.capture_session():
        for s in SIZES:
            backend.capture_one(ShapeKey(s), lambda s=s: xs[s] @ model.w)
    report = backend.memory_report()
    assert not report.fallbacks and all(k.shared for k in report.keys)
    assert report.resident_output_bytes == max(SIZES) * model.hidden * 4
    assert len({t for s in SIZES for t in _storages(backend.replay(ShapeKey(s)))}) == 1
    for x in xs.values():
        x.copy_(torch.randn_like(x))
    for s in SIZES:
        _assert_tree_equal(backend.replay(ShapeKey(s)), xs[s] @ model.w)


def test_reserved_buffer_that_capture_does_not_fit_is_not_used(backend_name: str) -> None:
    """The capture's output differs from the last warmup's (here: a dtype): the reservation is
    dropped and the capture's own output is adopted, never a wrong buffer."""
    model = Model()
    backend = make_backend(backend_name, share=True, strict_outputs=True, shared_buffer="reserve")
    x = torch.randn(16, model.hidden)
    calls = iter(range(100))

    def fwd() -> torch.Tensor:
        out = x @ model.w
        return out.double() if next(calls) == 2 else out  # warmups 0, 1 float; capture double

    with backend.capture_session():
        backend.capture_one(ShapeKey(16), fwd)
    out = backend.replay(ShapeKey(16))
    assert out.dtype == torch.float64
    assert backend.memory_report().resident_output_bytes == 16 * model.hidden * 8
