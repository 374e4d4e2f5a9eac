"""The backend contract, once, for every registered backend (Full, Breakable, Piecewise, and any
third-party backend installed beside them that takes a plain forward).

Each backend meets the same model through its own front: a plain call for Full, a
``@graph_break`` attention for Breakable, ``backend.compile(model)`` with the attention as a
splitting op for Piecewise. Every check compares replay against an eager forward on the same
inputs, after the inputs changed since capture.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

from sglang_bcg_plugin import (
    BackendOptions,
    CaptureStateError,
    OutputStructureError,
    ShapeKey,
    SharedOutputFallbackWarning,
    available_backends,
    create_backend,
    graph_break,
)
from sglang_bcg_plugin.plugin import CaptureState

H = 8
SIZES = [16, 8, 3]


@torch.library.custom_op("sglang_bcg_contract::attn", mutates_args=())
def attn_op(x: torch.Tensor) -> torch.Tensor:
    """The attention of the contract model, as a splitting op (Piecewise)."""
    return torch.softmax(x, dim=-1)


@attn_op.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@graph_break
def attn_break(x: torch.Tensor) -> torch.Tensor:
    """The same attention as a break point (Breakable)."""
    return torch.softmax(x, dim=-1)


class Model(torch.nn.Module):
    def __init__(self, attention: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.register_buffer("w1", torch.randn(H, H, generator=g) / H**0.5)
        self.register_buffer("w2", torch.randn(H, H, generator=g) / H**0.5)
        self.attention = attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attention(x @ self.w1) @ self.w2 + x


class Harness:
    """One backend, the model its front needs, and static inputs sized for the largest key."""

    def __init__(self, name: str, **options: Any) -> None:
        torch._dynamo.reset()
        kwargs: dict[str, Any] = {}
        if name == "piecewise":
            kwargs["splitting_ops"] = [attn_op]
        self.backend = create_backend(name, options=BackendOptions(engine="eager", **options), **kwargs)
        attention = {"breakable": attn_break, "piecewise": attn_op}.get(name, lambda x: torch.softmax(x, dim=-1))
        self.model = Model(attention)
        self.eager = Model(lambda x: torch.softmax(x, dim=-1))
        self.eager.load_state_dict(self.model.state_dict())
        self.fn = self.backend.compile(self.model)  # the model itself, unless the backend compiles
        self.x = torch.randn(max(SIZES), H)

    def forward(self, n: int) -> Callable[[], Any]:
        return lambda: self.fn(self.x[:n])

    def capture(self, keys: list[ShapeKey]) -> dict[ShapeKey, Any]:
        with torch.no_grad(), self.backend.capture_session():
            return {k: self.backend.capture_one(k, self.forward(k.size), capture_inputs=self.x) for k in keys}

    def check(self, keys: list[ShapeKey]) -> None:
        self.x.copy_(torch.randn_like(self.x))
        for k in keys:
            got = self.backend.replay(k)
            with torch.no_grad():
                torch.testing.assert_close(got, self.eager(self.x[: k.size]))


@pytest.fixture(params=available_backends())
def name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.mark.parametrize("mode", ["off", "on", "released"])
def test_replay_equals_eager_after_the_inputs_change(name: str, mode: str) -> None:
    h = Harness(name, output_mode=mode)
    keys = [ShapeKey(n) for n in SIZES]
    h.capture(keys)
    for _ in range(2):
        h.check(keys)
    assert h.backend.captured_keys() == keys and all(h.backend.can_run(k) for k in keys)


def test_sharing_on_keeps_one_output_per_partition(name: str) -> None:
    h = Harness(name, output_mode="on")
    keys = [ShapeKey(n, stream_idx=s) for s in (0, 1) for n in SIZES]
    outs = h.capture(keys)
    report = h.backend.memory_report()
    assert report.resident_output_bytes == 2 * max(SIZES) * H * 4  # one buffer per partition
    assert all(k.shared for k in report.keys) and not report.fallbacks
    p0 = {outs[k].untyped_storage().data_ptr() for k in keys if k.stream_idx == 0}
    p1 = {outs[k].untyped_storage().data_ptr() for k in keys if k.stream_idx == 1}
    assert len(p0) == len(p1) == 1 and p0 != p1  # partitions never alias
    h.check(keys)


def test_sharing_off_keeps_one_output_per_key(name: str) -> None:
    h = Harness(name, output_mode="off")
    keys = [ShapeKey(n) for n in SIZES]
    h.capture(keys)
    report = h.backend.memory_report()
    assert report.resident_output_bytes == sum(SIZES) * H * 4 and not any(k.shared for k in report.keys)


def test_capture_not_largest_first_falls_back_or_raises_in_strict_mode(name: str) -> None:
    h = Harness(name, output_mode="on")
    small, big = ShapeKey(3), ShapeKey(16)
    with pytest.warns(SharedOutputFallbackWarning, match=r"ShapeKey\(size=16.*capture was not largest-first"):
        h.capture([small, big])
    assert set(h.backend.memory_report().fallbacks) == {big}
    h.check([small, big])
    strict = Harness(name, output_mode="on", strict_outputs=True)
    with pytest.raises(OutputStructureError) as info:
        strict.capture([small, big])
    assert info.value.shape_key == big and not strict.backend.can_run(big) and strict.backend.can_run(small)


def test_session_rules(name: str) -> None:
    h = Harness(name)
    with pytest.raises(CaptureStateError, match="must run inside"):
        h.backend.capture_one(ShapeKey(3), h.forward(3))
    with h.backend.capture_session():
        with pytest.raises(CaptureStateError, match="do not nest"), h.backend.capture_session():
            pass  # pragma: no cover - the nested session never opens
        with torch.no_grad():
            h.backend.capture_one(ShapeKey(3), h.forward(3))
        with pytest.raises(ValueError, match="already captured"):
            h.backend.capture_one(ShapeKey(3), h.forward(3))
        with pytest.raises(CaptureStateError, match="inside an open capture_session"):
            h.backend.cleanup()
    with pytest.raises(KeyError, match=r"never captured .* captured sizes: \[3\]"):
        h.backend.replay(ShapeKey(4))
    # a plugin's engine driving the state itself (plugin API) gets the same error outside a session
    with pytest.raises(CaptureStateError, match="must run inside"):
        CaptureState(name, "eager").commit(ShapeKey(5), graph=object())


def test_cleanup_releases_everything_and_allows_recapture(name: str) -> None:
    h = Harness(name, output_mode="on")
    keys = [ShapeKey(n) for n in SIZES]
    h.capture(keys)
    h.backend.cleanup()
    assert h.backend.captured_keys() == [] and h.backend.memory_report().keys == ()
    h.capture(keys)
    h.check(keys)


def test_a_failed_capture_leaves_the_backend_as_it_was(name: str) -> None:
    h = Harness(name, output_mode="on")
    calls = {"n": 0}

    def failing() -> Any:
        calls["n"] += 1
        if calls["n"] > 2:  # the two warmups pass, the capture fails
            msg = "boom"
            raise RuntimeError(msg)
        return h.fn(h.x[:16])

    with torch.no_grad(), h.backend.capture_session():
        with pytest.raises(RuntimeError, match="boom"):
            h.backend.capture_one(ShapeKey(16), failing, capture_inputs=h.x)
        assert not h.backend.can_run(ShapeKey(16))
    keys = [ShapeKey(n) for n in SIZES]
    with warnings.catch_warnings():
        warnings.simplefilter("error", SharedOutputFallbackWarning)  # the failed key left no buffer behind
        h.capture(keys)
    h.check(keys)
