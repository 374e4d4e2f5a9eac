"""Output mode ``released`` on CPU: aliases, the pool-wide guard, and our own backends.

On a GPU a released output's memory goes back to the graph pool (``tests/gpu``). Here the
eager engine's "graph" keeps its output storage alive, so aliasing CPU memory is safe and the
mechanics (aliases handed out, nothing counted resident, values right) can be checked; the
poison primitive of the CPU wheel is stood in as in ``test_guard.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sglang_bcg_plugin import BackendOptions, ShapeKey, create_backend
from sglang_bcg_plugin.output import released as rel


@pytest.fixture
def cpu_is_pool_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rel, "ALIAS_DEVICE_TYPES", frozenset({"cpu"}))


def test_release_output_aliases_without_owning(cpu_is_pool_memory: None) -> None:
    base = torch.arange(12.0).reshape(4, 3)
    out = rel.release_output({"a": base[1:], "none": None, "empty": base[:0], "n": 3})
    a = out["a"]
    assert a.data_ptr() == base[1:].data_ptr() and a.stride() == base[1:].stride() and a.shape == (3, 3)
    assert a.untyped_storage() is not base.untyped_storage()
    base.add_(1)
    assert torch.equal(a, base[1:])  # same memory, a fresh storage object
    assert out["none"] is None and out["n"] == 3 and out["empty"].shape == (0, 3)
    assert rel.alias(torch.empty(0)).shape == (0,)


def test_release_output_keeps_non_pool_leaves() -> None:
    t = torch.ones(2)
    assert rel.release_output((t,))[0] is t  # CPU is not graph-pool memory by default


def test_release_needs_the_alias_primitive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch._C, "_construct_storage_from_data_pointer")
    assert not rel.released_supported()
    with pytest.raises(RuntimeError, match="lacks; use output_mode='on'"):
        rel.release_output(torch.ones(1))


def test_the_guard_poisons_released_outputs_of_other_graphs_of_the_pool(cpu_is_pool_memory: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang_bcg_plugin.output.guard import StaleOutputGuard

    poisoned: list[tuple[int, str]] = []
    monkeypatch.setattr(torch._C, "_set_storage_access_error_msg", lambda t, m: poisoned.append((id(t), m)), raising=False)
    guard, a_owner, b_owner = StaleOutputGuard(), object(), object()
    x = torch.ones(4, 2)
    first = guard.hand_out(a_owner, "k1", x, released=True, pool="pool")
    assert first.data_ptr() == x.data_ptr() and first is not x
    again = guard.hand_out(a_owner, "k1", x, released=True, pool="pool")  # the same graph: nothing poisoned
    assert poisoned == []
    guard.hand_out(b_owner, "k1", x, released=True, pool="other-pool")  # another pool: nothing poisoned
    assert poisoned == []
    guard.hand_out(b_owner, "k1", x, released=False, pool="pool")  # the same key of another backend
    assert [p[0] for p in poisoned] == [id(again)]
    assert "replay('k1') in output mode 'released'" in poisoned[0][1] and "another graph of the same pool" in poisoned[0][1]
    guard.hand_out(b_owner, "k2", (x, None), released=True, pool="pool")
    guard.forget(b_owner)
    guard.hand_out(a_owner, "k3", x, released=True, pool="pool")
    assert len(poisoned) == 1  # b's records (both pools, its partition) were forgotten
    assert [h.owner for h in guard._last.values()] == [id(a_owner)]  # private: the guard has no read API


def _capture(backend: Any, xs: dict[ShapeKey, torch.Tensor]) -> None:
    with backend.capture_session():
        for key, x in xs.items():
            backend.capture_one(key, lambda x=x: x * 2, capture_inputs=x)


@pytest.mark.parametrize("name", ["breakable", "full"])
def test_backends_released_on_the_eager_engine_keep_strong_outputs(name: str) -> None:
    backend = create_backend(name, options=BackendOptions(output_mode="released", engine="eager"))
    xs = {ShapeKey(8): torch.randn(8, 2), ShapeKey(4): torch.randn(4, 2)}
    _capture(backend, xs)
    report = backend.memory_report()
    assert report.resident_output_bytes == report.logical_output_bytes  # eager: like "off"
    assert not any(k.shared for k in report.keys)
    for key, x in xs.items():
        torch.testing.assert_close(backend.replay(key), x * 2)


def test_backend_released_on_a_pool_engine_hands_out_aliases(cpu_is_pool_memory: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The eager engine renamed "cuda" stands in for a pool engine (its graph keeps the memory)."""
    from sglang_bcg_plugin import accounting

    monkeypatch.setattr(accounting, "_reserved", lambda backend: None)  # no CUDA to measure
    backend = create_backend("breakable", options=BackendOptions(output_mode="released", engine="eager"))
    backend._get_engine().name = "cuda"  # type: ignore[misc]  # private: engine_name is read-only; a stand-in pool engine
    xs = {ShapeKey(8): torch.randn(8, 2), ShapeKey(4): torch.randn(4, 2)}
    with backend.capture_session():
        assert backend.output_mode_active == "released"
        outs = {k: backend.capture_one(k, lambda x=x: x * 2, capture_inputs=x) for k, x in xs.items()}
    assert backend.output_mode_active is None
    assert backend.memory_report().resident_output_bytes == 0
    for key, x in xs.items():
        x.copy_(torch.randn_like(x))
        out = backend.replay(key)
        assert out.data_ptr() == outs[key].data_ptr()
        torch.testing.assert_close(out, x * 2)
    backend.cleanup()


def _forecast(keeps_largest: bool) -> Any:
    from types import MappingProxyType

    from sglang_bcg_plugin.forecast.model import ModeForecast
    from sglang_bcg_plugin.forecast.probe import GraphMemoryForecast

    modes = {m: ModeForecast(m, 100, 90, 10, keeps_largest=keeps_largest and m == "released") for m in ("off", "on", "released")}
    return GraphMemoryForecast("breakable", (8, 4), "released", MappingProxyType(modes))


@pytest.mark.parametrize("keeps_largest", [True, False])
def test_released_keeps_the_largest_output_where_its_forecast_says_it_packs_tighter(
    cpu_is_pool_memory: None, monkeypatch: pytest.MonkeyPatch, keeps_largest: bool
) -> None:
    """After a forecast whose ``released`` keeps the largest output (the model found the pool
    tighter with it kept), the session's first capture hands out its own output, the rest
    aliases; the forecast goes with ``cleanup()``, so the next session releases every output."""
    from sglang_bcg_plugin import accounting

    monkeypatch.setattr(accounting, "_reserved", lambda backend: None)  # no CUDA to measure
    monkeypatch.setattr("sglang_bcg_plugin.backends.base.device_free_bytes", lambda collect=True: 0)
    backend = create_backend("breakable", options=BackendOptions(output_mode="released", engine="eager"))
    backend._get_engine().name = "cuda"  # type: ignore[misc]  # a stand-in pool engine, as above
    backend._state.forecast = _forecast(keeps_largest)  # private: a forecast needs CUDA probes
    assert backend._state.forecast.released_keeps_largest is keeps_largest
    xs = {ShapeKey(8): torch.randn(8, 2), ShapeKey(4): torch.randn(4, 2)}
    _capture(backend, xs)
    full = backend.memory_report()  # the plan says what the forecast steered, and why
    assert full.plan.released_keeps_largest is keeps_largest and full.to_dict()["plan"]["mode"] == "released"
    assert ("the largest capture keeps its output" in full.format()) is keeps_largest
    report = {k.key: k for k in full.keys}
    assert report[ShapeKey(8)].resident_output_bytes == (8 * 2 * 4 if keeps_largest else 0)
    assert report[ShapeKey(4)].resident_output_bytes == 0
    assert backend._state.entry(ShapeKey(8)).released is not keeps_largest
    for key, x in xs.items():
        x.copy_(torch.randn_like(x))
        torch.testing.assert_close(backend.replay(key), x * 2)
    _capture(backend, {ShapeKey(16): torch.randn(16, 2)})  # a later session adding a key keeps none
    assert backend._state.entry(ShapeKey(16)).released
    assert not backend.memory_report().plan.released_keeps_largest
    backend.cleanup()
    assert backend._state.forecast is None
    backend._get_engine().name = "cuda"  # type: ignore[misc]  # cleanup() released the stand-in
    _capture(backend, xs)  # no forecast now: every output released
    assert backend.memory_report().resident_output_bytes == 0
    backend.cleanup()


def test_a_kept_largest_output_is_guarded_like_a_released_one(cpu_is_pool_memory: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the stale-output guard on, the kept output keeps ``released``'s contract (valid until
    another graph of the partition replays), the same as every released one: the kept graph's
    replay poisons the released output handed out before it (its forward may overwrite that
    free memory), and the next replay of another graph poisons the kept output's view."""
    from sglang_bcg_plugin import accounting

    poisoned: list[int] = []
    monkeypatch.setattr(torch._C, "_set_storage_access_error_msg", lambda t, m: poisoned.append(t.data_ptr()), raising=False)
    monkeypatch.setattr(accounting, "_reserved", lambda backend: None)
    monkeypatch.setattr("sglang_bcg_plugin.backends.base.device_free_bytes", lambda collect=True: 0)
    backend = create_backend("breakable", options=BackendOptions(output_mode="released", engine="eager", stale_output_guard=True))
    backend._get_engine().name = "cuda"  # type: ignore[misc]  # a stand-in pool engine, as above
    backend._state.forecast = _forecast(True)  # private: a forecast needs CUDA probes
    xs = {ShapeKey(8): torch.randn(8, 2), ShapeKey(4): torch.randn(4, 2)}
    _capture(backend, xs)
    small = backend.replay(ShapeKey(4))  # released: an alias of pool memory
    assert poisoned == []
    large = backend.replay(ShapeKey(8))  # the kept graph ran: the released output is stale
    assert poisoned == [small.data_ptr()]
    torch.testing.assert_close(large, xs[ShapeKey(8)] * 2)
    again = backend.replay(ShapeKey(4))
    assert poisoned == [small.data_ptr(), large.data_ptr()]
    torch.testing.assert_close(again, xs[ShapeKey(4)] * 2)
    backend.cleanup()


@pytest.mark.parametrize("name", ["breakable", "full", "piecewise"])
def test_the_eager_engines_report_says_what_released_and_the_guard_did(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the eager engine ``released`` keeps every output (no graph pool) and, on a torch build
    that cannot poison storages, the guard is not armed: ``format()`` and the plan say so, and claim
    neither a release nor a guard; with the poison primitive there the guard is armed and named."""
    monkeypatch.delattr(torch._C, "_set_storage_access_error_msg", raising=False)
    backend = create_backend(name, options=BackendOptions(output_mode="released", engine="eager", stale_output_guard=True))
    fn = backend.compile(lambda x: x * 3) if name == "piecewise" else (lambda x: x * 3)
    xs = {ShapeKey(16): torch.randn(16, 64), ShapeKey(8): torch.randn(8, 64)}
    with pytest.warns(RuntimeWarning, match="cannot poison storages"), backend.capture_session():
        for key, x in xs.items():
            backend.capture_one(key, lambda x=x: fn(x), capture_inputs=x)
    report = backend.memory_report()
    text, plan = report.format(), report.to_dict()["plan"]
    assert report.resident_output_bytes == report.logical_output_bytes == (16 + 8) * 64 * 4 and report.saved_bytes == 0
    assert "eager engine: no graph pool to release outputs into, so nothing is released" in text
    assert "releases its output" not in text and "keeps its output" not in text and "buffer (" not in text
    assert "guard asked for but not armed: this torch build cannot poison storages" in text
    assert not text.rstrip().endswith("; guard")
    assert plan["mode"] == "released" and plan["releases_outputs"] is False and plan["engine"] == "eager"
    assert plan["guard"] is True and plan["guard_armed"] is False
    for key, x in xs.items():
        out = backend.replay(key)
        assert out.untyped_storage() is backend.replay(key).untyped_storage()  # owned, not a fresh alias
        torch.testing.assert_close(out, x * 3)
    backend.cleanup()
    monkeypatch.setattr(torch._C, "_set_storage_access_error_msg", lambda t, m: None, raising=False)
    backend.configure(output_mode="off")
    with backend.capture_session():
        backend.capture_one(ShapeKey(4), lambda: fn(xs[ShapeKey(8)][:4]))
    text = backend.memory_report().format()
    assert text.endswith("mode off (BackendOptions.output_mode='off'); guard") and "not armed" not in text
    assert backend.memory_report().plan.guard_armed


def test_a_pool_engines_plan_keeps_its_wording(cpu_is_pool_memory: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool engine's line (the eager engine renamed "cuda" stands in, as above) is unchanged:
    the buffer, the largest capture releasing its output, the guard."""
    from sglang_bcg_plugin import accounting

    monkeypatch.setattr(accounting, "_reserved", lambda backend: None)
    monkeypatch.setattr(torch._C, "_set_storage_access_error_msg", lambda t, m: None, raising=False)
    backend = create_backend("full", options=BackendOptions(output_mode="released", engine="eager", stale_output_guard=True))
    backend._get_engine().name = "cuda"  # type: ignore[misc]  # a stand-in pool engine
    _capture(backend, {ShapeKey(8): torch.randn(8, 2)})
    report = backend.memory_report()
    assert report.format().endswith("; reserve buffer (auto: no forecast, a reserved buffer costs one output at most); "
                                    "the largest capture releases its output; guard")
    assert report.plan.releases_outputs and report.resident_output_bytes == 0
    backend.cleanup()


def test_a_resumed_session_keeps_the_largest_where_the_first_captured_nothing() -> None:
    """A live switch's first session (incremental capture) captures no size: the session that captures the largest
    later still keeps its output, as a fresh capture's would; after a first key, a resumed session keeps none."""
    from sglang_bcg_plugin.output.mode import Resolution
    from sglang_bcg_plugin.output.plan import SessionPlan
    from sglang_bcg_plugin.output.policy import OutputPolicy

    plan = SessionPlan(Resolution("released", "test"), "adopt", "test", released_keeps_largest=True)
    policy = OutputPolicy()
    policy.open(plan)
    policy.close()  # nothing captured
    policy.open(plan, resume=True)
    assert policy.keep_first
    policy.keep_first = False  # what a commit of the first key does
    policy.close()
    policy.open(plan, resume=True)
    assert not policy.keep_first
    policy.close()
    policy.open(plan)  # a fresh session: as its plan says
    assert policy.keep_first
