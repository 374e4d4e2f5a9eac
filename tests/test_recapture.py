"""Recapture cycles: 20 x (capture every size, replay, cleanup), toggling sharing every cycle.

On CPU (eager engine) "no leak" means: every output, buffer and graph of a cycle dies at its
``cleanup()`` (weak references), and the number of live Python objects and live tensors after
cycle 20 is not above the number after cycle 2 (same sharing setting; warm caches).
``tests/gpu/test_reliability_gpu.py`` measures device memory for the same loop on the H200.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import torch

from _support import make_backend
from sglang_bcg_plugin import ShapeKey

SIZES = [64, 48, 32, 16, 8, 4, 2, 1]
H = 8
CYCLES = 20


def _forward(w: torch.Tensor, x: torch.Tensor) -> dict[str, Any]:
    h = x @ w
    return {"hidden": h, "logits": (h[:, :3] * 2).repeat(2, 1), "aux": (torch.tanh(h), None)}


def _leaves(out: dict[str, Any]) -> list[torch.Tensor]:
    return [out["hidden"], out["logits"], out["aux"][0]]


def _replay_and_check(backend: Any, w: torch.Tensor, inputs: dict[ShapeKey, torch.Tensor]) -> list[Any]:
    """Replay every key, compare with eager, return weak references to every handed-out leaf."""
    refs = []
    for key, x in inputs.items():
        out = backend.replay(key)
        for a, b in zip(_leaves(out), _leaves(_forward(w, x)), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        refs.extend(weakref.ref(t) for t in _leaves(out))
    return refs


def _count_live() -> tuple[int, int]:
    gc.collect()
    objs = gc.get_objects()
    tensors = sum(1 for o in objs if issubclass(type(o), torch.Tensor))  # type(): no __class__ lookups
    return len(objs), tensors


def test_twenty_recapture_cycles_toggling_sharing(backend_name: str) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(H, H, generator=g)
    inputs = {ShapeKey(s): torch.randn(s, H, generator=g) for s in SIZES}
    backend = make_backend(backend_name, share=True)
    counts: dict[int, tuple[int, int]] = {}
    logical = sum(_forward(w, x)["hidden"].numel() * 4 * (1 + 0.75 + 1) for x in inputs.values())

    for cycle in range(1, CYCLES + 1):
        share = cycle % 2 == 1
        backend.configure(share_output=share)
        with backend.capture_session():
            assert backend.share_output_active is share
            for key, x in inputs.items():
                backend.capture_one(key, lambda x=x: _forward(w, x), capture_inputs=x)
        for x in inputs.values():
            x.copy_(torch.randn(x.shape, generator=g))
        refs = _replay_and_check(backend, w, inputs)
        report = backend.memory_report()
        assert report.logical_output_bytes == logical
        assert not report.fallbacks
        assert all(k.shared is share for k in report.keys)
        if share:
            big = SIZES[0]
            assert report.resident_output_bytes == (big * H + 2 * big * 3 + big * H) * 4
        else:
            assert report.resident_output_bytes == report.logical_output_bytes
        del report
        backend.cleanup()
        assert backend.captured_keys() == []
        assert backend.memory_report().resident_output_bytes == 0
        alive = [r for r in refs if r() is not None]
        # no gc.collect(): the outputs must die by reference counting alone (no cycles)
        assert not alive, f"cycle {cycle}: {len(alive)} output tensors outlived cleanup()"
        if cycle in (1, 2, CYCLES - 1, CYCLES):
            counts[cycle] = _count_live()

    # cycles 2 and 20 both ran with sharing off; cycle 1 and 19 with it on
    objs2, tensors2 = counts[2]
    objs20, tensors20 = counts[CYCLES]
    assert tensors20 <= tensors2, f"live tensors grew: {tensors2} after cycle 2, {tensors20} after cycle {CYCLES}"
    assert objs20 <= objs2, f"live objects grew: {objs2} after cycle 2, {objs20} after cycle {CYCLES}"
    objs1, tensors1 = counts[1]
    objs19, tensors19 = counts[CYCLES - 1]
    assert tensors19 <= tensors1 and objs19 <= objs1, (counts[1], counts[CYCLES - 1])


def test_recapture_same_keys_after_cleanup_hands_out_fresh_storage(backend_name: str) -> None:
    """A key captured again after ``cleanup()`` must not read the old cycle's buffer."""
    w = torch.randn(H, H)
    xs = {ShapeKey(s): torch.randn(s, H) for s in (16, 8)}
    backend = make_backend(backend_name, share=True)
    with backend.capture_session():
        for key, x in xs.items():
            backend.capture_one(key, lambda x=x: x @ w, capture_inputs=x)
    old = backend.replay(ShapeKey(8))
    old_values = old.clone()
    backend.cleanup()
    w2 = torch.randn(H, H)
    with backend.capture_session():
        for key, x in xs.items():
            backend.capture_one(key, lambda x=x: x @ w2, capture_inputs=x)
    new = backend.replay(ShapeKey(8))
    torch.testing.assert_close(new, xs[ShapeKey(8)] @ w2, rtol=0, atol=0)
    # the caller kept the old view alive: it is its own memory now, untouched by new replays
    torch.testing.assert_close(old, old_values, rtol=0, atol=0)
    assert old.untyped_storage().data_ptr() != new.untyped_storage().data_ptr()
