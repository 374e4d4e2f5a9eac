"""Shared buffers allocated from the last warmup (``prealloc``) vs adopted from the first capture.

Graph memory is a GPU measurement (``tests/gpu``); here: the strategy switch, the buffer's
shape, that values and sharing are the same as with ``adopt``, and the rollback.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from _support import Model, make_backend
from sglang_bcg_plugin import OutputStructureError, SharedOutputFallbackWarning, ShapeKey
from sglang_bcg_plugin.prealloc import ENGINE_DEFAULTS, WarmupSeeder, buffer_strategy, seed_partition, template_of
from sglang_bcg_plugin.sharing import OutputSharer

ENV = "SGLANG_BCG_SHARED_BUFFER"


def test_strategy_defaults_and_override() -> None:
    assert buffer_strategy("breakable", "sglang-bcg", {}) == ENGINE_DEFAULTS[("breakable", "sglang-bcg")] == "prealloc"
    assert buffer_strategy("breakable", "eager", {}) == "adopt"  # the eager "graph" owns nothing
    assert buffer_strategy("full", "cuda", {ENV: " PreAlloc "}) == "prealloc"
    assert buffer_strategy("breakable", "cuda", {ENV: "adopt"}) == "adopt"
    assert buffer_strategy("full", "cuda", {ENV: ""}) == ENGINE_DEFAULTS[("full", "cuda")]
    with pytest.raises(ValueError, match=f"{ENV}='copy' is not a buffer strategy"):
        buffer_strategy("full", "cuda", {ENV: "copy"})


def test_template_keeps_the_tree_and_grows_padded_rows() -> None:
    out = {"rows": torch.ones(6, 3)[:, :2], "one": torch.ones(1, 3), "scalar": torch.tensor(2.0), "n": 4}
    t = template_of(out, capacity_rows=10)
    assert t["rows"].shape == (10, 2) and t["rows"].is_contiguous() and t["one"].shape == (1, 3)
    assert t["scalar"].shape == () and t["n"] == 4
    assert template_of(out, capacity_rows=2)["rows"].shape == (6, 2)


def test_seed_partition_declines_what_the_capture_must_decide() -> None:
    key = ShapeKey(4)
    assert seed_partition(OutputSharer(enabled=False, strict=False), key, torch.ones(4)) is None
    on = OutputSharer(enabled=True, strict=False)
    assert seed_partition(on, key, None) is None
    assert seed_partition(on, key, torch.tensor(1.0)) is None  # 0-dim: the capture warns once itself
    assert seed_partition(OutputSharer(enabled=True, strict=True), key, torch.tensor(1.0)) is None
    holder = type("Opaque", (), {})()
    holder.t = torch.ones(2)
    assert seed_partition(on, key, holder) is None  # the capture raises the real TypeError
    seed = seed_partition(on, key, torch.ones(4, 2))
    assert seed is not None and seed_partition(on, ShapeKey(2), torch.ones(2, 2)) is None  # one per partition
    assert on.partitions[None].buffers[0].shape == (4, 2)
    seed.rollback()
    assert on.partitions == {}
    seed.rollback()  # idempotent


@pytest.fixture
def prealloc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "prealloc")


@pytest.mark.usefixtures("prealloc")
def test_prealloc_on_a_backend_shares_like_adopt(backend_name: str) -> None:
    backend, model = make_backend(backend_name, share=True), Model()
    hooks: list[int] = []
    keys = [ShapeKey(s) for s in (16, 8, 4)]
    with backend.capture_session():
        outs = [backend.capture_one(k, lambda k=k: model.input_for(k, k.size) * 2, post_warmup_hook=lambda: hooks.append(1)) for k in keys]
    assert len(hooks) == 2 * len(keys)
    first = model.input_for(keys[0], 16)
    assert outs[0].untyped_storage().data_ptr() != first.untyped_storage().data_ptr()  # not adopted: copied
    assert len({o.untyped_storage().data_ptr() for o in outs}) == 1
    model.refill()
    for key in keys:
        torch.testing.assert_close(backend.replay(key), model.input_for(key, key.size) * 2)
    assert backend.memory_report().resident_output_bytes == 16 * model.hidden * 4


@pytest.mark.usefixtures("prealloc")
def test_prealloc_rolls_back_when_the_first_capture_fails(backend_name: str) -> None:
    backend, model = make_backend(backend_name, share=True), Model()
    calls = {"n": 0}

    def failing() -> Any:
        calls["n"] += 1
        if calls["n"] == 3:  # the capture call, after two warmups seeded the partition
            raise RuntimeError("boom")
        return model.input_for("big", 16) * 2

    with backend.capture_session():
        with pytest.raises(RuntimeError, match="boom"):
            backend.capture_one(ShapeKey(16), failing)
        assert backend._session.sharer.partitions == {}  # type: ignore[union-attr]
        small = backend.capture_one(ShapeKey(4), lambda: model.input_for("small", 4) * 2)
    assert small.shape == (4, model.hidden) and backend.memory_report().resident_output_bytes == 4 * model.hidden * 4


@pytest.mark.usefixtures("prealloc")
def test_prealloc_strict_mismatch_still_raises(backend_name: str) -> None:
    backend = make_backend(backend_name, share=True, strict_outputs=True)
    with backend.capture_session():
        backend.capture_one(ShapeKey(8), lambda: torch.ones(8, 2))
        with pytest.raises(OutputStructureError, match="dtype changed"):
            backend.capture_one(ShapeKey(4), lambda: torch.ones(4, 2, dtype=torch.float64))


def test_warmup_seeder_without_a_user_hook_and_zero_dim() -> None:
    sharer = OutputSharer(enabled=True, strict=False)
    seeder = WarmupSeeder(sharer, ShapeKey(2), lambda: torch.tensor(1.0), None, 1)
    seeder.forward()
    seeder.hook()
    assert seeder.seed is None and sharer.partitions == {}
    seeder.rollback()
    with pytest.warns(SharedOutputFallbackWarning, match="0-dim"):
        sharer.prepare(ShapeKey(2), seeder.forward())
