"""The Breakable front-end's boundary rule (``engines/breakable.py``), recorded on CPU.

Stand-in: the segments are :class:`EagerSegments` (no CUDA graph is captured, so returned values
are copied at once and references stay strong); ``released.ALIAS_DEVICE_TYPES`` is widened to
``cpu`` where a test checks what the replay step keeps on a GPU (non-owning aliases), with the
tensors kept alive by the test as a graph pool keeps its memory. What is tested is what the
recorder decides — what is passed as is, what gets memory of its own, what replay refreshes —
not graph replay itself, which ``tests/gpu`` covers on the H200.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from sglang_bcg_plugin import graph_break
from sglang_bcg_plugin.engines.breakable import BreakableRecorder
from sglang_bcg_plugin.engines.recorder import SegmentedGraph, record
from sglang_bcg_plugin.engines.tape import EagerSegments
from sglang_bcg_plugin.output.trees import storage_key

seen: list[tuple[torch.Tensor, torch.Tensor]] = []


@graph_break(reads=("q", "k"))
def attend(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Returns a fresh tensor shaped unlike its inputs (``[1, seq, heads, d]``)."""
    seen.append((q, k))
    return (q * 2 + k.sum()).transpose(1, 2).contiguous()


@graph_break(reads=("q",), writes=("q",))
def in_place(q: torch.Tensor) -> torch.Tensor:
    return q.mul_(3)  # returns its argument


@graph_break(reads=("q",))
def head(q: torch.Tensor) -> torch.Tensor:
    return q[..., :4]  # a view of its argument


def _record(fn: Callable[..., Any], *args: object) -> tuple[SegmentedGraph, Any]:
    rec = BreakableRecorder("key", EagerSegments())
    graph = record(rec, lambda: fn(*args), lambda out: out)
    return graph, graph.output


def test_arguments_are_passed_as_they_are_and_returns_get_memory_of_their_own() -> None:
    seen.clear()
    q, k = torch.randn(1, 4, 16, 8), torch.randn(1, 8)
    graph, out = _record(attend, q, k)
    assert seen[0][0] is q and seen[0][1] is k  # no bridge copy in
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(out, (q * 2 + k.sum()).transpose(1, 2))
    assert graph.num_segments == 2 and len(graph.steps) == 1
    static = out.clone()
    q.add_(1)  # the segment before the break rewrites q in place at every replay
    graph.replay()
    torch.testing.assert_close(out, (q * 2 + k.sum()).transpose(1, 2))  # refreshed in place
    assert not torch.equal(out, static)
    graph.release()
    assert graph.steps == ()


def test_return_aliasing_an_argument_is_passed_as_is() -> None:
    q = torch.randn(1, 4, 8, 8)
    expect = q * 3
    graph, out = _record(in_place, q)
    assert storage_key(out) == storage_key(q)
    torch.testing.assert_close(out, expect)
    graph.replay()  # writes q in place again, no copy over itself
    torch.testing.assert_close(q, expect * 3)
    q2 = torch.randn(1, 4, 8, 8)
    _, view = _record(head, q2)
    assert storage_key(view) == storage_key(q2)


def test_on_a_gpu_the_step_keeps_named_arguments_and_returns_through_non_owning_aliases(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What lets the pool reuse q/k/v once the model drops them (the H200 figures)."""
    from sglang_bcg_plugin.output import released

    monkeypatch.setattr(released, "ALIAS_DEVICE_TYPES", frozenset({"cpu", "cuda"}))
    q, k = torch.randn(1, 4, 16, 8), torch.randn(1, 8)
    graph, out = _record(attend, q, k)
    step: Any = graph.steps[0]  # a break's step: its call and what it keeps
    kept_q = step.args[0]
    assert kept_q is not q and kept_q.data_ptr() == q.data_ptr()  # same memory ...
    assert kept_q.untyped_storage() is not q.untyped_storage()  # ... through a storage that owns nothing
    assert step.outs[0].data_ptr() == out.data_ptr() and step.outs[0] is not out
    q.add_(1)
    graph.replay()
    torch.testing.assert_close(out, (q * 2 + k.sum()).transpose(1, 2))


def test_unnamed_tensor_arguments_and_plain_values_are_held_as_they_are() -> None:
    @graph_break(reads=("q",))
    def scaled(q: torch.Tensor, w: torch.Tensor, scale: float, extra: None = None) -> torch.Tensor:
        return q @ w * scale

    q, w = torch.randn(4, 8), torch.randn(8, 8)
    graph, out = _record(scaled, q, w, 2.0)
    step: Any = graph.steps[0]  # a break's step: its call and what it keeps
    assert step.args[1] is w and step.args[2] == 2.0 and "extra" not in step.kwargs
    w.mul_(-1)
    graph.replay()
    torch.testing.assert_close(out, q @ w * 2.0)


def test_replay_step_rejects_a_changed_return_shape() -> None:
    calls = []

    @graph_break(reads=("q",))
    def moody(q: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return q[:, :, :2] * 1 if len(calls) > 1 else q * 1

    graph, _ = _record(moody, torch.randn(1, 2, 4, 8))
    with pytest.raises(RuntimeError, match=r"break .*moody at output returned shape \(1, 2, 2, 8\) on replay"):
        graph.replay()


def test_replay_step_rejects_a_changed_number_of_returned_tensors() -> None:
    calls = []

    @graph_break(reads=("q",))
    def fickle(q: torch.Tensor) -> tuple[torch.Tensor, ...]:
        calls.append(1)
        return (q * 1,) if len(calls) == 1 else (q * 1, q * 2)

    graph, _ = _record(fickle, torch.randn(2, 4))
    with pytest.raises(RuntimeError, match="fickle returned 2 tensors on replay, captured 1"):
        graph.replay()


def test_nested_break_runs_inline_and_non_tensors_pass() -> None:
    @graph_break(reads=("q",))
    def widen(q: torch.Tensor) -> torch.Tensor:
        return torch.cat([q, q], dim=-1)

    @graph_break(reads=("q",))
    def outer(q: torch.Tensor, scale: float, extra: None) -> tuple[torch.Tensor, int]:
        return widen(q) * scale, 7  # a break inside a break is a plain call

    x = torch.randn(1, 2, 4, 8)
    graph, (out, seven) = _record(outer, x, 2.0, None)
    torch.testing.assert_close(out, torch.cat([x, x], dim=-1) * 2.0)
    assert seven == 7 and len(graph.steps) == 1
    graph.replay()


class _Holder:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def test_a_break_returning_an_unsupported_object_is_named() -> None:
    """A ``@graph_break`` returning an object that hides a tensor was reported "at output": the
    error names the break function, at capture and (a return changed to one) at replay."""
    @graph_break(reads=("q",))
    def holds(q: torch.Tensor) -> _Holder:
        return _Holder(q * 2)

    with pytest.raises(TypeError) as info:
        _record(holds, torch.randn(2, 4))
    msg = str(info.value)
    name = holds.__qualname__  # graph_break keeps the function's name
    assert msg.startswith(f"@graph_break function {name} returned a value replay cannot track: unsupported output type _Holder")
    assert f"(at {name}(...).t)" in msg and " at output" not in msg

    calls: list[int] = []

    @graph_break(reads=("q",))
    def turns(q: torch.Tensor) -> Any:
        calls.append(1)
        return q * 1 if len(calls) == 1 else _Holder(q * 1)

    graph, _ = _record(turns, torch.randn(2, 4))
    with pytest.raises(TypeError, match=r"@graph_break function .*turns returned a value replay cannot track: unsupported output type _Holder"):
        graph.replay()
