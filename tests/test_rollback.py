"""Rollback: a forward that raises during warmup or capture leaves the backend consistent.

Eager engine (CPU), Full and Breakable backends, sharing on and off. After the failure: the
earlier keys still replay the right values, the failed key is absent (from the graphs, the
report and the sharing policy), the shared buffer holds what it held before, and capturing the
failed key again in the same session works. ``tests/gpu/test_reliability_gpu.py`` repeats this
on real CUDA graphs (plus a real out-of-memory inside the capture).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from _support import make_backend
from sglang_bcg_plugin import ShapeKey, SharedOutputFallbackWarning, hookimpl
from sglang_bcg_plugin.manager import get_plugin_manager

H = 6
NUM_WARMUPS = 2  # the default; call number NUM_WARMUPS + 1 is the capture run


class Boom(RuntimeError):
    pass


class Net:
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.w = torch.randn(H, H, generator=g)
        self.xs: dict[ShapeKey, torch.Tensor] = {}

    def x(self, key: ShapeKey) -> torch.Tensor:
        if key not in self.xs:
            self.xs[key] = torch.randn(key.size, H)
        return self.xs[key]

    def forward(self, key: ShapeKey) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        x = self.x(key)
        h = x @ self.w
        return h, {"act": torch.tanh(h), "pooled": h.sum(0, keepdim=True)}

    def fn(self, key: ShapeKey) -> Callable[[], Any]:
        return lambda: self.forward(key)

    def failing(self, key: ShapeKey, fail_on_call: int) -> Callable[[], Any]:
        calls = {"n": 0}

        def fn() -> Any:
            calls["n"] += 1
            if calls["n"] == fail_on_call:
                raise Boom(f"forward failed on call {fail_on_call}")
            return self.forward(key)

        return fn

    def refill(self) -> None:
        for x in self.xs.values():
            x.copy_(torch.randn_like(x))


def _leaves(out: Any) -> list[torch.Tensor]:
    h, d = out
    return [h, d["act"], d["pooled"]]


def _assert_out(out: Any, expected: Any) -> None:
    for a, b in zip(_leaves(out), _leaves(expected), strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _check_replays(backend: Any, net: Net, keys: list[ShapeKey]) -> None:
    net.refill()
    for key in keys:
        _assert_out(backend.replay(key), net.forward(key))


def _storages(out: Any) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in _leaves(out)}


# fail_on_call: 1 and 2 are the warmups, 3 is the capture run
FAIL_CALLS = [1, 2, NUM_WARMUPS + 1]


@pytest.mark.parametrize("share", [True, False], ids=["share_on", "share_off"])
@pytest.mark.parametrize("fail_on_call", FAIL_CALLS, ids=["warmup1", "warmup2", "capture"])
def test_failed_later_key_rolls_back(backend_name: str, share: bool, fail_on_call: int) -> None:
    net = Net()
    backend = make_backend(backend_name, share)
    big, mid, failed, small = ShapeKey(32), ShapeKey(16), ShapeKey(8), ShapeKey(4)
    with backend.capture_session():
        backend.capture_one(big, net.fn(big), capture_inputs=net.x(big))
        backend.capture_one(mid, net.fn(mid), capture_inputs=net.x(mid))
        before_report = backend.memory_report()
        owner_out = backend.replay(big)
        snapshot = [t.clone() for t in _leaves(owner_out)]

        with pytest.raises(Boom, match=f"call {fail_on_call}"):
            backend.capture_one(failed, net.failing(failed, fail_on_call), capture_inputs=net.x(failed))

        # the failed key is absent everywhere
        assert not backend.can_run(failed) and not backend.can_run(failed)
        assert backend.captured_keys() == [big, mid]
        with pytest.raises(KeyError, match="never captured"):
            backend.replay(failed)
        after_report = backend.memory_report()
        assert [k.key for k in after_report.keys] == [big, mid]
        assert after_report.resident_output_bytes == before_report.resident_output_bytes
        assert after_report.logical_output_bytes == before_report.logical_output_bytes
        assert not after_report.fallbacks
        # the shared buffer (the largest key's own output) was not touched by the failure
        for t, s in zip(_leaves(owner_out), snapshot, strict=True):
            torch.testing.assert_close(t, s, rtol=0, atol=0)
        # the session is still open and usable: the failed key captures again, then another
        assert backend.output_mode_active == ("on" if share else "off")
        backend.capture_one(failed, net.fn(failed), capture_inputs=net.x(failed))
        backend.capture_one(small, net.fn(small), capture_inputs=net.x(small))

    keys = [big, mid, failed, small]
    _check_replays(backend, net, keys)
    report = backend.memory_report()
    assert not report.fallbacks
    assert all(k.shared is share for k in report.keys)
    if share:
        assert len(set.union(*(_storages(backend.replay(k)) for k in keys))) == 3  # one per leaf
        assert report.resident_output_bytes == (32 * H * 2 + H) * 4
    else:
        assert report.resident_output_bytes == report.logical_output_bytes
    backend.cleanup()
    assert backend.captured_keys() == []


@pytest.mark.parametrize("fail_on_call", FAIL_CALLS, ids=["warmup1", "warmup2", "capture"])
def test_failed_first_key_creates_no_partition(backend_name: str, fail_on_call: int) -> None:
    """The first (largest) key of a partition fails: no half-made buffer stays behind.

    Its retry adopts its own output as the buffer, and the smaller keys share it; another
    partition captured before is untouched.
    """
    net = Net()
    backend = make_backend(backend_name, True)
    other = ShapeKey(8, 1)
    keys = [ShapeKey(32, 0), ShapeKey(16, 0), ShapeKey(8, 0)]
    with backend.capture_session():
        backend.capture_one(other, net.fn(other), capture_inputs=net.x(other))
        with pytest.raises(Boom):
            backend.capture_one(keys[0], net.failing(keys[0], fail_on_call), capture_inputs=net.x(keys[0]))
        assert backend.captured_keys() == [other]
        for key in keys:
            backend.capture_one(key, net.fn(key), capture_inputs=net.x(key))
    _check_replays(backend, net, [other, *keys])
    report = backend.memory_report()
    assert not report.fallbacks
    owner = backend.replay(keys[0])
    for key in keys[1:]:
        assert _storages(backend.replay(key)) == _storages(owner)
    assert not (_storages(owner) & _storages(backend.replay(other)))
    assert report.resident_output_bytes == (32 * H * 2 + H) * 4 + (8 * H * 2 + H) * 4


def test_failed_largest_retried_after_smaller_falls_back_never_wrong(backend_name: str) -> None:
    """Largest key fails, a smaller key is captured first (it becomes the buffer owner), then the
    largest is retried: it cannot fit, so it keeps its own output with a warning — right values."""
    net = Net()
    backend = make_backend(backend_name, True)
    big, small = ShapeKey(32), ShapeKey(8)
    with backend.capture_session():
        with pytest.raises(Boom):
            backend.capture_one(big, net.failing(big, NUM_WARMUPS + 1), capture_inputs=net.x(big))
        backend.capture_one(small, net.fn(small), capture_inputs=net.x(small))
        with pytest.warns(SharedOutputFallbackWarning, match="largest-first"):
            backend.capture_one(big, net.fn(big), capture_inputs=net.x(big))
    _check_replays(backend, net, [small, big])
    assert list(backend.memory_report().fallbacks) == [big]


def test_post_warmup_hook_failure_rolls_back(backend_name: str) -> None:
    """A failing ``post_warmup_hook`` (e.g. a distributed barrier timing out) is a warmup failure."""
    net = Net()
    backend = make_backend(backend_name, True)
    big, small = ShapeKey(16), ShapeKey(8)

    def bad_hook() -> None:
        raise Boom("barrier timed out")

    with backend.capture_session():
        backend.capture_one(big, net.fn(big), capture_inputs=net.x(big))
        with pytest.raises(Boom, match="barrier"):
            backend.capture_one(small, net.fn(small), capture_inputs=net.x(small), post_warmup_hook=bad_hook)
        assert not backend.can_run(small)
        backend.capture_one(small, net.fn(small), capture_inputs=net.x(small), post_warmup_hook=lambda: None)
    _check_replays(backend, net, [big, small])
    assert all(k.shared for k in backend.memory_report().keys)


def test_failure_leaves_no_pending_stats_and_session_closes(backend_name: str) -> None:
    """Nothing is recorded for a failed key; leaving the session by an
    exception closes it (the next session opens), and the captured keys stay."""
    net = Net()
    backend = make_backend(backend_name, True)
    big, failed = ShapeKey(16), ShapeKey(8)
    with pytest.raises(Boom), backend.capture_session():
        backend.capture_one(big, net.fn(big), capture_inputs=net.x(big))
        backend.capture_one(failed, net.failing(failed, NUM_WARMUPS + 1), capture_inputs=net.x(failed))
    assert backend.output_mode_active is None
    report = backend.memory_report()
    assert set(report.capture_seconds) == {big}
    with backend.capture_session():
        backend.capture_one(failed, net.fn(failed), capture_inputs=net.x(failed))
    _check_replays(backend, net, [big, failed])
    assert set(backend.memory_report().capture_seconds) == {big, failed}


class _Observer:
    """A third-party plugin observing every capture: it must see the failure before it propagates."""

    def __init__(self) -> None:
        self.seen: list[tuple[object, str]] = []

    @hookimpl
    def sglang_bcg_capture_finished(self, backend: Any, shape_key: object, report: Any, error: Any) -> None:
        self.seen.append((shape_key, "ok" if error is None else type(error).__name__))
        assert (report is None) == (error is not None)


def test_failure_reaches_observers_then_propagates(backend_name: str) -> None:
    net = Net()
    obs = _Observer()
    pm = get_plugin_manager()
    pm.register(obs, name="test-observer")
    try:
        backend = make_backend(backend_name, True)
        big, failed = ShapeKey(16), ShapeKey(8)
        with backend.capture_session():
            backend.capture_one(big, net.fn(big), capture_inputs=net.x(big))
            with pytest.raises(Boom):
                backend.capture_one(failed, net.failing(failed, 1), capture_inputs=net.x(failed))
            backend.capture_one(failed, net.fn(failed), capture_inputs=net.x(failed))
        assert obs.seen == [(big, "ok"), (failed, "Boom"), (failed, "ok")]
        _check_replays(backend, net, [big, failed])
    finally:
        pm.unregister(obs)


class _FailsAfterFinalize:
    """Wraps the eager engine: the capture (and the output policy) runs, then the engine fails,
    as a CUDA ``capture_end`` error would after the output was finalized."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = inner.name
        self.failures_left = 1

    def capture(self, request: Any) -> Any:
        graph = self.inner.capture(request)
        if self.failures_left:
            self.failures_left -= 1
            graph.release()
            raise Boom("capture_end failed")
        return graph

    def bridge_bytes(self) -> dict[int | None, int]:
        return self.inner.bridge_bytes()  # type: ignore[no-any-return]

    def release(self) -> None:
        self.inner.release()


def test_failure_after_output_policy_ran_commits_nothing(backend_name: str) -> None:
    """The first key of a partition fails after its output was adopted as the buffer: the
    partition must not keep that buffer, so the next (smaller) key adopts its own output."""
    net = Net()
    backend = make_backend(backend_name, True)
    big, mid, small = ShapeKey(32), ShapeKey(16), ShapeKey(8)
    with backend.capture_session():
        backend._engine = _FailsAfterFinalize(backend._engine)  # private: fault injection, no public engine seam
        with pytest.raises(Boom, match="capture_end"):
            backend.capture_one(big, net.fn(big), capture_inputs=net.x(big))
        assert backend.captured_keys() == []
        backend.capture_one(mid, net.fn(mid), capture_inputs=net.x(mid))
        backend.capture_one(small, net.fn(small), capture_inputs=net.x(small))
    _check_replays(backend, net, [mid, small])
    report = backend.memory_report()
    assert not report.fallbacks and all(k.shared for k in report.keys)
    # only the 16-row output is resident: no trace of the failed 32-row adoption
    assert report.resident_output_bytes == (16 * H * 2 + H) * 4
    assert _storages(backend.replay(small)) == _storages(backend.replay(mid))
