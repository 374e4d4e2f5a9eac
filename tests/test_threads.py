"""Threads: concurrent replays and a concurrent change of the sharing setting.

The rule every CUDA-graph runner follows (and the sharing policy relies on): graphs of one
partition (``stream_idx``) never replay concurrently; graphs of different partitions may. So
each replay thread owns one partition and checks every output right after its replay. While
they run, other threads flip ``configure(output_mode=...)`` and open capture sessions for a
third partition: a change applies at the next session only, never to graphs already captured,
and never corrupts an in-flight replay.
"""

from __future__ import annotations

from sglang_bcg_plugin.output.mode import mode_of_option

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from _support import make_backend
from sglang_bcg_plugin import ShapeKey

H = 16
SIZES = [64, 32, 16, 8]
REPLAYS_PER_THREAD = 150


def _run_threads(targets: list[Callable[[], None]], timeout: float = 60.0) -> None:
    errors: list[BaseException] = []

    def wrap(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - reported to the main thread
                errors.append(exc)

        return run

    threads = [threading.Thread(target=wrap(t), daemon=True) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a worker thread hung"
    if errors:
        raise errors[0]


class Partitioned:
    """Per partition: its own weights, so an output read from another partition is wrong."""

    def __init__(self, partitions: list[int]) -> None:
        g = torch.Generator().manual_seed(0)
        self.w = {p: torch.randn(H, H, generator=g) for p in partitions}
        self.x = {ShapeKey(s, p): torch.randn(s, H, generator=g) for p in partitions for s in SIZES}
        self.expected = {k: self.forward(k) for k in self.x}

    def forward(self, key: ShapeKey) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.x[key] @ self.w[key.stream_idx]
        return h, torch.tanh(h).repeat(2, 1)

    def capture(self, backend: Any, partitions: list[int]) -> None:
        with backend.capture_session():
            for p in partitions:
                for s in SIZES:
                    key = ShapeKey(s, p)
                    backend.capture_one(key, lambda key=key: self.forward(key), capture_inputs=self.x[key])


def _replayer(backend: Any, model: Partitioned, partition: int, seen: dict[int, int]) -> Callable[[], None]:
    def run() -> None:
        for i in range(REPLAYS_PER_THREAD):
            key = ShapeKey(SIZES[i % len(SIZES)], partition)
            out = backend.replay(key)
            for got, want in zip(out, model.expected[key], strict=True):
                assert got.shape == want.shape, key
                torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{key} replay {i}")
            seen[partition] = seen.get(partition, 0) + 1

    return run


@pytest.mark.parametrize("share", [True, False], ids=["share_on", "share_off"])
def test_concurrent_replays_one_thread_per_partition(backend_name: str, share: bool) -> None:
    partitions = [0, 1, 2, 3]
    model = Partitioned(partitions)
    backend = make_backend(backend_name, share)
    model.capture(backend, partitions)
    seen: dict[int, int] = {}
    _run_threads([_replayer(backend, model, p, seen) for p in partitions])
    assert seen == {p: REPLAYS_PER_THREAD for p in partitions}
    report = backend.memory_report()
    assert all(k.shared is share for k in report.keys) and not report.fallbacks
    if share:
        big = SIZES[0]
        assert report.resident_output_bytes == len(partitions) * (big * H + 2 * big * H) * 4


def test_sharing_toggle_during_replays_applies_at_next_session(backend_name: str) -> None:
    """Replays of partitions 0 and 1 run while another thread flips the switch and captures a
    third partition in new sessions; each session follows the setting it opened with."""
    model = Partitioned([0, 1, 2])
    backend = make_backend(backend_name, True)
    model.capture(backend, [0, 1])
    before = backend.memory_report()
    stop = threading.Event()
    sessions: list[tuple[bool, list[bool]]] = []

    overlapped: list[int] = []

    def toggler() -> None:
        share = True
        for _ in range(2000):  # start once the replays are running
            if seen or stop.is_set():
                break
            stop.wait(0.001)
        while not stop.is_set() and len(sessions) < 40:
            share = not share
            backend.configure(output_mode=mode_of_option(share))
            keys = [ShapeKey(s, 2, f"t{len(sessions)}") for s in SIZES]
            with backend.capture_session():
                active = backend.output_mode_active == "on"
                for key in keys:
                    x = model.x[ShapeKey(key.size, 2)]
                    backend.capture_one(key, lambda x=x: x @ model.w[2], capture_inputs=x)
            for key in keys:
                torch.testing.assert_close(backend.replay(key), model.x[ShapeKey(key.size, 2)] @ model.w[2])
            sessions.append((bool(active), [k.shared for k in backend.memory_report().keys if k.key in keys]))
            if not stop.is_set():
                overlapped.append(len(sessions))

    seen: dict[int, int] = {}
    replayers = [_replayer(backend, model, p, seen) for p in (0, 1)]

    def replay_then_stop() -> None:
        try:
            _run_threads(replayers)
        finally:
            stop.set()

    _run_threads([replay_then_stop, toggler])
    assert seen == {0: REPLAYS_PER_THREAD, 1: REPLAYS_PER_THREAD}
    assert overlapped, "no capture session completed while the replays were running"
    for i, (active, shared) in enumerate(sessions):
        assert active is (i % 2 == 1)  # flipped before every session, starting from off
        assert shared == [active] * len(SIZES), (i, active, shared)
    # the graphs captured before the flips keep their storage and sharing
    after = {k.key: k for k in backend.memory_report().keys}
    for k in before.keys:
        assert after[k.key].shared is True
        assert after[k.key].resident_output_bytes == k.resident_output_bytes
    for p in (0, 1):
        for s in SIZES:
            key = ShapeKey(s, p)
            for got, want in zip(backend.replay(key), model.expected[key], strict=True):
                torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_configure_from_another_thread_mid_session_does_not_change_it(backend_name: str) -> None:
    model = Partitioned([0])
    backend = make_backend(backend_name, True)
    keys = [ShapeKey(s, 0) for s in SIZES]
    with backend.capture_session():
        backend.capture_one(keys[0], lambda: model.forward(keys[0]), capture_inputs=model.x[keys[0]])
        _run_threads([lambda: backend.configure(output_mode="off")])
        assert backend.options.output_mode == "off"
        assert backend.output_mode_active == "on"
        for key in keys[1:]:
            backend.capture_one(key, lambda key=key: model.forward(key), capture_inputs=model.x[key])
    assert all(k.shared for k in backend.memory_report().keys)
    ptrs = {backend.replay(k)[0].untyped_storage().data_ptr() for k in keys}
    assert len(ptrs) == 1
    with backend.capture_session():
        assert backend.output_mode_active == "off"


def test_second_session_from_another_thread_is_refused(backend_name: str) -> None:
    """Sessions do not nest, across threads too: a concurrent session open fails loudly."""
    from sglang_bcg_plugin import CaptureStateError

    backend = make_backend(backend_name, True)
    raised: list[BaseException] = []

    def other() -> None:
        try:
            with backend.capture_session():
                pass  # pragma: no cover
        except CaptureStateError as exc:
            raised.append(exc)

    with backend.capture_session():
        _run_threads([other])
    assert len(raised) == 1 and "already open" in str(raised[0])
    with backend.capture_session():  # the refused open left nothing behind
        assert backend.output_mode_active == "on"
