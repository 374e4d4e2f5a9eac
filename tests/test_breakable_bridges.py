"""The Breakable front-end's bridges (``engines/breakable.py``), recorded on CPU.

Stand-in: the segments are :class:`EagerSegments` (no CUDA graph is captured, so the copies that
a graph would record run at once); what is tested is what the recorder decides — which slots
exist, what a returned tensor reuses, what replay steps refresh — not graph replay itself, which
``tests/gpu`` covers on the H200.
"""

from __future__ import annotations

import pytest
import torch

from sglang_bcg_plugin import graph_break
from sglang_bcg_plugin.engines.breakable import BreakableRecorder
from sglang_bcg_plugin.engines.recorder import EagerSegments, record
from sglang_bcg_plugin.storage import SlotStore


@graph_break(reads=("q", "k"))
def attend(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Returns a fresh tensor shaped unlike its inputs (``[1, seq, heads, d]``)."""
    return (q * 2 + k.sum()).transpose(1, 2).contiguous()


@graph_break(reads=("q",))
def widen(q: torch.Tensor) -> torch.Tensor:
    return torch.cat([q, q], dim=-1)  # more elements than any read slot


@graph_break(reads=("q",), writes=("q",))
def in_place(q: torch.Tensor) -> torch.Tensor:
    return q.mul_(3)  # returns its (bridged) argument


def forward(x: torch.Tensor, fn: object) -> torch.Tensor:
    q = x.reshape(1, 4, -1, 8)  # [1, heads, seq, d]: the size is on dim 2
    k = x[:1].clone()
    return fn(q + 1, k) if fn is attend else fn(q + 1)  # type: ignore[operator]


def _record(store: SlotStore, x: torch.Tensor, fn: object) -> tuple[object, torch.Tensor]:
    rec = BreakableRecorder("key", EagerSegments(), store)
    graph = record(rec, lambda: forward(x, fn), lambda out: out)
    return graph, graph.output  # type: ignore[attr-defined]


def test_returned_tensor_reuses_the_dead_read_slot() -> None:
    store = SlotStore()
    for seq in (16, 8):  # largest first: one slot per argument name serves both
        x = torch.randn(4 * seq, 8)
        graph, out = _record(store, x, attend)
        torch.testing.assert_close(out, attend(x.reshape(1, 4, -1, 8) + 1, x[:1].clone()))
        assert graph.num_segments == 2 and len(graph._steps) == 1  # type: ignore[attr-defined]
    names = sorted(name for name, _, _ in store._slots)
    assert names == ["arg:attend:k", "arg:attend:q"]  # no ret: slot: the output took q's
    assert store.nbytes() == (4 * 16 * 8 + 8) * 4


def test_return_larger_than_every_read_slot_gets_its_own() -> None:
    store = SlotStore()
    x = torch.randn(32, 8)
    _, out = _record(store, x, widen)
    torch.testing.assert_close(out, widen(x.reshape(1, 4, -1, 8) + 1))
    assert sorted(name for name, _, _ in store._slots) == ["arg:widen:q", "ret:widen:output"]


def test_return_aliasing_an_argument_slot_reuses_nothing() -> None:
    store = SlotStore()
    x = torch.randn(32, 8)
    graph, out = _record(store, x, in_place)
    torch.testing.assert_close(out, (x.reshape(1, 4, -1, 8) + 1) * 3)
    assert sorted(name for name, _, _ in store._slots) == ["arg:in_place:q", "ret:in_place:output"]
    graph.replay()  # type: ignore[attr-defined]  # the step re-runs the break on its slots


def test_replay_step_rejects_a_changed_return_shape() -> None:
    store = SlotStore()
    calls = []

    @graph_break(reads=("q",))
    def moody(q: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return q[:, :, :2] if len(calls) > 1 else q * 1

    rec = BreakableRecorder("key", EagerSegments(), store)
    graph = record(rec, lambda: moody(torch.randn(1, 2, 4, 8)), lambda out: out)
    with pytest.raises(RuntimeError, match=r"break .*moody at output returned shape \(1, 2, 2, 8\) on replay"):
        graph.replay()


def test_nested_break_runs_inline_and_non_tensors_pass() -> None:
    store = SlotStore()

    @graph_break(reads=("q",))
    def outer(q: torch.Tensor, scale: float, extra: None) -> tuple[torch.Tensor, int]:
        return widen(q) * scale, 7  # a break inside a break is a plain call

    rec = BreakableRecorder("key", EagerSegments(), store)
    x = torch.randn(1, 2, 4, 8)
    graph = record(rec, lambda: outer(x, 2.0, None), lambda out: out)
    out, seven = graph.output
    torch.testing.assert_close(out, torch.cat([x, x], dim=-1) * 2.0)
    assert seven == 7 and len(graph._steps) == 1
    graph.replay()


@graph_break(reads=("q",))
def head(q: torch.Tensor) -> torch.Tensor:
    return q[..., :4]  # a view of the read slot itself


def test_return_viewing_a_read_slot_is_not_copied_over_it() -> None:
    store = SlotStore()
    x = torch.randn(32, 8)
    graph, out = _record(store, x, head)
    torch.testing.assert_close(out, (x.reshape(1, 4, -1, 8) + 1)[..., :4])
    assert sorted(name for name, _, _ in store._slots) == ["arg:head:q", "ret:head:output"]
