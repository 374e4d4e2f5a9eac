"""Output modes of our backend inside SGLang's real BCG machinery, on CPU (``cpu_graph_standin``).

The default follows the installed SGLang; ``released`` hands out aliases (the stand-in's
segments keep their output storage, so aliasing CPU memory is safe here); the stale-output
guard (poison primitive stood in) covers every backend of the process-global pool;
``cleanup()`` leaves SGLang's global pool handle usable; the buffer strategy and its rollback.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cpu_graph_standin import FakeRunner
from sglang_bcg_plugin.output import released as rel
from test_sglang_breakable import SIZES, Model, capture_all, make_backend, replay, shape_key, storages

pytestmark = [pytest.mark.sglang, pytest.mark.usefixtures("backend_seam", "cpu_bcg")]
ENV = "SGLANG_ENABLE_BCG_SHARED_OUTPUT"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (ENV, "SGLANG_BCG_SHARED_BUFFER", "SGLANG_BCG_STALE_OUTPUT_GUARD", "SGLANG_ENABLE_GRAPH_POOL_BORROW"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def poison(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, str]]:
    poisoned: list[tuple[int, str]] = []
    monkeypatch.setattr(torch._C, "_set_storage_access_error_msg", lambda t, m: poisoned.append((id(t), m)), raising=False)
    monkeypatch.setattr(rel, "ALIAS_DEVICE_TYPES", frozenset({"cpu"}))
    monkeypatch.setenv("SGLANG_BCG_STALE_OUTPUT_GUARD", "1")
    return poisoned


def test_default_is_the_installed_sglangs_behaviour() -> None:
    backend, model = make_backend(), Model()
    assert backend.last_output_mode is None
    keys = [shape_key(n) for n in SIZES]
    with backend.capture_session(None):
        assert backend.output_mode_active == "on"
        for key in keys:
            backend.capture_one(key, model.forward_for(key))
    assert backend.output_mode_active is None
    assert backend.last_output_mode.source.startswith("default: on, the installed SGLang's own behaviour")
    assert len(storages(backend)) == 1


@pytest.mark.parametrize("strategy", ["adopt", "reserve"])
def test_both_buffer_strategies_share_one_buffer(monkeypatch: pytest.MonkeyPatch, strategy: str) -> None:
    monkeypatch.setenv("SGLANG_BCG_SHARED_BUFFER", strategy)
    backend, model = make_backend(), Model()
    keys = [shape_key(n) for n in SIZES]
    capture_all(backend, model, keys)
    assert len(storages(backend)) == 1
    model.refill()
    for key in keys:
        torch.testing.assert_close(replay(backend, key), model.expected(key), rtol=0, atol=0)


class CapacityRunner(FakeRunner):
    def __init__(self, capacity: object) -> None:
        super().__init__()
        self.capacity = capacity

    def cuda_graph_output_capacity_rows(self, output: object) -> Any:
        return self.capacity


def test_reserve_honours_the_capacity_hook() -> None:
    backend, model = make_backend(CapacityRunner(32)), Model()
    keys = [shape_key(n) for n in SIZES]
    capture_all(backend, model, keys)
    # private: SGLang's backend keeps its outputs in _outputs; replay needs a forward batch
    (buffer_rows,) = {out.untyped_storage().nbytes() // (8 * 4) for out in backend._outputs.values()}
    assert buffer_rows == 32
    with pytest.raises(TypeError, match="cuda_graph_output_capacity_rows"):
        capture_all(make_backend(CapacityRunner(2.0)), Model(), keys)


def test_reservation_of_a_failed_capture_is_not_kept() -> None:
    backend, model = make_backend(), Model()
    big, small = shape_key(16), shape_key(4)
    calls = {"n": 0}
    inner = model.forward_for(big)

    def failing() -> Any:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return inner()

    with backend.capture_session(None):
        with pytest.raises(RuntimeError, match="boom"):
            backend.capture_one(big, failing)
        assert backend._bcg_state.policy.partitions == {}  # private: a reservation is not in memory_report()
        backend.capture_one(small, model.forward_for(small))
    assert backend.memory_report().resident_output_bytes == 4 * 8 * 4


def test_released_hands_out_aliases(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rel, "ALIAS_DEVICE_TYPES", frozenset({"cpu"}))
    monkeypatch.setenv(ENV, "Released")
    backend, model = make_backend(), Model()
    keys = [shape_key(n) for n in SIZES]
    capture_all(backend, model, keys)
    assert backend.last_output_mode.mode == "released"
    report = backend.memory_report()
    assert report.resident_output_bytes == 0 and report.logical_output_bytes > 0
    assert not any(k.shared for k in report.keys)
    model.refill()
    for key in keys:
        torch.testing.assert_close(replay(backend, key), model.expected(key), rtol=0, atol=0)


def test_released_refuses_graph_pool_borrowing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "released")
    monkeypatch.setenv("SGLANG_ENABLE_GRAPH_POOL_BORROW", "1")
    from sglang_bcg_plugin.sglang.compat import pool_borrowing_exists

    backend = make_backend()
    if pool_borrowing_exists():  # a release that lends free pool blocks to eager tensors
        with pytest.raises(ValueError, match="borrow"), backend.capture_session(None):
            pass  # pragma: no cover
    else:  # nothing borrows the pool: released is safe
        with backend.capture_session(None):
            assert backend.output_mode_active == "released"
    monkeypatch.setenv(ENV, "1")
    with backend.capture_session(None):
        assert backend.output_mode_active == "on"


def test_guard_poisons_released_outputs_across_backends_of_the_pool(monkeypatch: pytest.MonkeyPatch, poison: list[tuple[int, str]]) -> None:
    monkeypatch.setenv(ENV, "released")
    model = Model()
    prefill, decode = make_backend(), make_backend()
    capture_all(prefill, model, [shape_key(16), shape_key(8)])
    capture_all(decode, model, [shape_key(4)])
    assert prefill._pool == decode._pool  # SGLang's process-global pool  # private: SGLang's attribute
    a = replay(prefill, shape_key(16))
    again = replay(prefill, shape_key(16))
    assert poison == [] and again.data_ptr() == a.data_ptr() and again is not a
    replay(decode, shape_key(4))
    assert [p[0] for p in poison] == [id(again)] and "size=4" in poison[0][1]
    prefill.cleanup()
    decode.cleanup()


def test_guard_on_shared_outputs_poisons_within_the_partition(monkeypatch: pytest.MonkeyPatch, poison: list[tuple[int, str]]) -> None:
    monkeypatch.setenv(ENV, "1")
    backend, model = make_backend(), Model()
    capture_all(backend, model, [shape_key(16), shape_key(8)])
    a = replay(backend, shape_key(16))
    replay(backend, shape_key(8))
    assert [p[0] for p in poison] == [id(a)] and "same partition" in poison[0][1]
    guard = backend._bcg_state.policy.guard
    backend.cleanup()
    # private: the guard has no read API; cleanup() forgot every record of this backend
    assert all(h.owner != id(backend._bcg_state) for h in guard._last.values())


def test_guard_unsupported_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch._C, "_set_storage_access_error_msg", raising=False)
    monkeypatch.setenv("SGLANG_BCG_STALE_OUTPUT_GUARD", "1")
    backend = make_backend()
    with pytest.warns(RuntimeWarning, match="cannot poison storages"), backend.capture_session(None):
        pass
    assert backend._bcg_state.policy.guard is None  # private: no public "guard active" read


def test_cleanup_leaves_the_global_pool_usable(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.model_executor.runner_utils import pool

    from sglang_bcg_plugin.sglang.sglang_session import drop_global_pool

    from conftest import seam

    backend, model = make_backend(), Model()
    for env in ("1", "0", "released", "1"):
        monkeypatch.setenv(ENV, env)
        capture_all(backend, model, [shape_key(8), shape_key(4)])
        if seam().global_pool:  # 0.5.15+: one pool per process; 0.5.14: one per backend
            assert pool.get_global_graph_memory_pool() == backend._pool  # private: SGLang's attribute
        backend.cleanup()
        assert pool.get_global_graph_memory_pool() is None  # the next session gets a fresh handle
    pool.set_global_graph_memory_pool(("other", 1))
    assert drop_global_pool(("mine", 0)) is False and drop_global_pool(None) is False
    assert pool.get_global_graph_memory_pool() == ("other", 1)
    pool.set_global_graph_memory_pool(None)
