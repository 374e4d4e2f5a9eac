"""Our breakable backend driven through the installed SGLang's real BCG machinery, on CPU.

Only the CUDA graph primitive (``torch.cuda.CUDAGraph``, one BCG segment), the TP group's
``barrier`` and the runner's ``graph_pool_handle`` are stood in (``cpu_graph_standin``: each
segment records its aten ops and replays them with our eager engine's semantics, writing the
storage it captured). Keys are the release's real ``ShapeKey``; the forward has a real
``eager_on_graph`` break point, so every key has two segments and one break function.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

from cpu_graph_standin import FakeRunner
from sglang_bcg_plugin import CaptureStateError, MemoryReport, SharedOutputFallbackWarning

pytestmark = [pytest.mark.sglang, pytest.mark.usefixtures("backend_seam", "cpu_bcg")]

HIDDEN = 8
SIZES = (16, 8, 4)


class Model:
    """Static inputs per key; ``x @ w`` (segment 1), an eager break (``tanh``), ``* 2`` (segment 2)."""

    def __init__(self) -> None:
        from conftest import eager_break

        g = torch.Generator().manual_seed(0)
        self.w = torch.randn(HIDDEN, HIDDEN, generator=g)
        self.inputs: dict[Any, torch.Tensor] = {}
        self.attention = eager_break(lambda h: torch.tanh(h))

    def forward_for(self, key: Any, rows: int | None = None, make: Callable[[torch.Tensor], Any] | None = None) -> Callable[[], Any]:
        x = self.inputs.setdefault(key, torch.randn(rows or key.size, HIDDEN))

        def forward() -> Any:
            out = self.attention(x @ self.w) * 2
            return out if make is None else make(out)

        return forward

    def expected(self, key: Any) -> torch.Tensor:
        return torch.tanh(self.inputs[key] @ self.w) * 2

    def refill(self) -> None:
        for x in self.inputs.values():
            x.copy_(torch.randn_like(x))


def shape_key(size: int, stream_idx: int | None = None) -> Any:
    from sglang.srt.model_executor.runner.shape_key import ShapeKey

    return ShapeKey(size=size, stream_idx=stream_idx)  # the other fields differ per release


def make_backend(runner: Any = None, **kwargs: Any) -> Any:
    from sglang_bcg_plugin.sglang import sglang_breakable_backend_class

    return sglang_breakable_backend_class()(runner or FakeRunner(), **kwargs)


def capture_all(backend: Any, model: Model, keys: list[Any], **kw: Any) -> None:
    with backend.capture_session(None):
        for key in keys:
            backend.capture_one(key, model.forward_for(key, **kw))


def replay(backend: Any, key: Any) -> Any:
    with backend.replay_session():
        return backend.replay(key, None)


def storages(backend: Any) -> set[int]:
    # private: SGLang's backend keeps its outputs in _outputs; replay needs a forward batch
    return {t.untyped_storage().data_ptr() for out in backend._outputs.values() for t in _leaves(out)}


def _leaves(out: Any) -> list[torch.Tensor]:
    from sglang_bcg_plugin.output.trees import flatten

    return [t for _, t in flatten(out)[1]]


def test_is_sglang_bcg_subclass_with_sglang_constructor() -> None:
    from sglang.srt.model_executor.runner_backend.breakable_cuda_graph_backend import BreakableCudaGraphBackend

    backend = make_backend(enable_memory_saver=False, debug_eager=False)
    assert isinstance(backend, BreakableCudaGraphBackend)
    assert backend._debug_eager is False and backend.output_mode_active is None  # private: SGLang keeps the argument only there


@pytest.mark.parametrize(("env", "expect_storages"), [("1", 1), ("0", len(SIZES))])
def test_flag_decides_output_storages_and_replay_is_correct(
    monkeypatch: pytest.MonkeyPatch, env: str, expect_storages: int
) -> None:
    monkeypatch.setenv("SGLANG_ENABLE_BCG_SHARED_OUTPUT", env)
    backend, model = make_backend(), Model()
    keys = [shape_key(n) for n in SIZES]  # largest first, as SGLang's runners capture
    capture_all(backend, model, keys)
    # private: SGLang's graphs and their segments and breaks have no public read
    assert [len(backend._graphs[k]._segments) for k in keys] == [2, 2, 2]
    assert [len(backend._graphs[k]._break_fns) for k in keys] == [1, 1, 1]
    assert len(storages(backend)) == expect_storages
    model.refill()  # outputs must follow the inputs, not the capture-time values
    for key in reversed(keys):
        out = replay(backend, key)
        assert out.shape == (key.size, HIDDEN)
        torch.testing.assert_close(out, model.expected(key), rtol=0, atol=0)
    report = backend.memory_report()
    assert isinstance(report, MemoryReport) and report.engine == "sglang-bcg"
    full = sum(16 * HIDDEN * 4 * n // 16 for n in SIZES)
    assert report.logical_output_bytes == full
    assert report.resident_output_bytes == (16 * HIDDEN * 4 if env == "1" else full)
    assert all(k.shared == (env == "1") and k.num_segments == 2 for k in report.keys)


def test_dataclass_output_shares_per_leaf(monkeypatch: pytest.MonkeyPatch) -> None:
    """``LogitsProcessorOutput`` (SGLang's decode output): SGLang's own BCG raises TypeError."""
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.model_executor.runner_backend.breakable_cuda_graph_backend import BreakableCudaGraphBackend

    monkeypatch.setenv("SGLANG_ENABLE_BCG_SHARED_OUTPUT", "1")

    def make(h: torch.Tensor) -> Any:
        return LogitsProcessorOutput(next_token_logits=h + 1, hidden_states=h)

    model, keys = Model(), [shape_key(n) for n in SIZES]
    sglang_own = BreakableCudaGraphBackend(FakeRunner())
    with sglang_own.capture_session(None), pytest.raises(TypeError, match="Unsupported BCG output type"):
        sglang_own.capture_one(keys[0], model.forward_for(keys[0], make=make))

    backend = make_backend()
    capture_all(backend, model, keys, make=make)
    assert len(storages(backend)) == 2  # one buffer per leaf path, not per key
    model.refill()
    for key in keys:
        out = replay(backend, key)
        assert isinstance(out, LogitsProcessorOutput)
        torch.testing.assert_close(out.hidden_states, model.expected(key), rtol=0, atol=0)
        torch.testing.assert_close(out.next_token_logits, model.expected(key) + 1, rtol=0, atol=0)
        assert out.next_token_logprobs is None


def test_runner_rows_trim_padded_leaves_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_ENABLE_BCG_SHARED_OUTPUT", "1")
    backend, model = make_backend(FakeRunner(rows=3)), Model()
    per_request = torch.arange(2.0)

    keys = [shape_key(n) for n in SIZES]
    capture_all(backend, model, keys, make=lambda h: (h, per_request * 1))
    model.refill()
    for key in keys:
        tokens, requests = replay(backend, key)
        assert tokens.shape == (3, HIDDEN) and requests.shape == (2,)
        torch.testing.assert_close(tokens, model.expected(key)[:3], rtol=0, atol=0)
    assert len(storages(backend)) == 2


def test_streams_never_share(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_ENABLE_BCG_SHARED_OUTPUT", "1")
    backend, model = make_backend(), Model()
    keys = [shape_key(n, stream_idx=s) for s in (0, 1) for n in SIZES]
    capture_all(backend, model, keys)
    # private: SGLang's backend keeps its outputs in _outputs; replay needs a forward batch
    by_stream = {s: {backend._outputs[k].untyped_storage().data_ptr() for k in keys if k.stream_idx == s} for s in (0, 1)}
    assert len(by_stream[0]) == len(by_stream[1]) == 1
    assert by_stream[0].isdisjoint(by_stream[1])


def test_not_largest_first_falls_back_per_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_ENABLE_BCG_SHARED_OUTPUT", "1")
    backend, model = make_backend(), Model()
    small, big = shape_key(4), shape_key(8)
    with pytest.warns(SharedOutputFallbackWarning, match="capture was not largest-first"):
        capture_all(backend, model, [small, big])
    assert set(backend.memory_report().fallbacks) == {big}
    model.refill()
    for key in (small, big):
        torch.testing.assert_close(replay(backend, key), model.expected(key), rtol=0, atol=0)


def test_the_flag_overrides_the_operators_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    """The flag's hook writes ``SGLANG_ENABLE_BCG_SHARED_OUTPUT`` (its one carrier); the session
    reads it, with it as the reason."""
    import argparse

    from sglang_bcg_plugin.sglang import flag

    monkeypatch.setenv("SGLANG_ENABLE_BCG_SHARED_OUTPUT", "1")  # the operator's
    result = object()
    assert flag.after_from_cli_args(result, object, argparse.Namespace(enable_bcg_shared_output="off")) is result
    backend, model = make_backend(), Model()
    with backend.capture_session(None):
        assert backend.output_mode_active == "off"
        for n in SIZES:
            backend.capture_one(shape_key(n), model.forward_for(shape_key(n)))
    assert backend.last_output_mode.describe() == "off (SGLANG_ENABLE_BCG_SHARED_OUTPUT='0')"
    assert len(storages(backend)) == len(SIZES)


def test_debug_eager_runs_forward_as_one_break(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_ENABLE_BCG_SHARED_OUTPUT", "1")
    backend, model = make_backend(debug_eager=True), Model()
    keys = [shape_key(n) for n in SIZES]
    capture_all(backend, model, keys)
    assert all(len(backend._graphs[k]._break_fns) == 1 for k in keys)  # private: SGLang's graphs' breaks
    assert len(storages(backend)) == 1
    model.refill()
    for key in keys:
        torch.testing.assert_close(replay(backend, key), model.expected(key), rtol=0, atol=0)


def test_lifecycle_errors_and_cleanup() -> None:
    backend, model = make_backend(), Model()
    key = shape_key(4)
    with pytest.raises(CaptureStateError, match="capture_session"):
        backend.capture_one(key, model.forward_for(key))
    capture_all(backend, model, [key], )
    assert backend.can_run(None, key) and len(backend.memory_report().keys) == 1
    backend.cleanup()
    assert not backend.can_run(None, key) and backend.memory_report().keys == ()


def test_helpers() -> None:
    from sglang_bcg_plugin.output.state import input_storages as _input_storages
    from sglang_bcg_plugin.sglang.sglang_session import apply_runner_rows, runner_server_args

    t = torch.zeros(4, 2)
    with pytest.raises(TypeError, match="expected None or an int"):
        apply_runner_rows(t, 2.0)
    with pytest.raises(ValueError, match="expected None or an int"):
        apply_runner_rows(t, -1)
    assert apply_runner_rows(t, 9) is t and apply_runner_rows(None, 1) is None
    assert apply_runner_rows(t, None) is t and apply_runner_rows(t, 1).shape == (1, 2)

    class Batch:  # holds an unsupported tensor holder: flatten() refuses it
        def __init__(self) -> None:
            self.input_ids = t
            self.other = type("Opaque", (), {"__init__": lambda s: setattr(s, "x", t)})()

    assert _input_storages(Batch()) == frozenset({("cpu", t.untyped_storage().data_ptr())})
    assert _input_storages(dataclasses.make_dataclass("B", ["a"])(t)) == _input_storages(Batch())
    assert runner_server_args(object()) is None  # nothing published in this process


def test_static_inputs_never_become_the_shared_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The largest key's output *is* its static input (capture_inputs): adopting it as the
    buffer would let smaller keys' in-graph copies overwrite that input."""
    monkeypatch.setenv("SGLANG_ENABLE_BCG_SHARED_OUTPUT", "1")
    backend, model = make_backend(), Model()
    big, small = shape_key(8), shape_key(4)
    x_big = torch.randn(8, HIDDEN)
    before = x_big.clone()
    hooks: list[Any] = []
    with backend.capture_session(None):
        backend.capture_one(big, lambda: x_big, capture_inputs={"x": x_big}, post_warmup_hook=lambda: hooks.append(big))
        backend.capture_one(small, model.forward_for(small), post_warmup_hook=lambda: hooks.append(small))
    assert hooks == [big, big, small, small]  # two warmups per key, each followed by the hook
    # private: what a key's record holds is not public (CaptureState.entry is, behind _bcg_state)
    entry = backend._bcg_state.entry(big)
    assert entry is not None and entry.capture_inputs == {"x": x_big}  # held strongly with the graph
    replay(backend, small)
    torch.testing.assert_close(x_big, before, rtol=0, atol=0)
    assert backend._outputs[big].untyped_storage().data_ptr() != x_big.untyped_storage().data_ptr()  # private: SGLang's outputs


def test_server_args_published_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    runtime_context = pytest.importorskip("sglang.srt.runtime_context")

    from sglang_bcg_plugin.sglang.sglang_session import runner_server_args

    published = object()
    monkeypatch.setattr(runtime_context, "get_server_args", lambda: published, raising=False)  # <= 0.5.14: absent
    assert runner_server_args(FakeRunner()) is published  # the runner's model_runner has none
    mine = object()
    assert runner_server_args(FakeRunner(server_args=mine)) is mine


def test_one_full_collection_per_session_and_gc_off_during_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """GC safety without a full collection per key: SGLang captures dozens of sizes and a full
    collection of a serving process takes a noticeable fraction of a second (the H200 run of 10
    recapture cycles x 74 sizes went from 75 s to over 110 s with one per key)."""
    import gc

    monkeypatch.setenv("SGLANG_ENABLE_BCG_SHARED_OUTPUT", "1")
    backend, model = make_backend(), Model()
    full: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 2:
            full.append(1)

    enabled: list[bool] = []
    keys = [shape_key(n) for n in SIZES]
    gc.callbacks.append(count)
    try:
        with backend.capture_session(None):
            for key in keys:
                backend.capture_one(key, model.forward_for(key))
                enabled.append(gc.isenabled())
    finally:
        gc.callbacks.remove(count)
    assert len(full) == 1 and enabled == [False] * len(keys)
    assert gc.isenabled()  # restored when the session closed


def test_capture_one_takes_the_installed_releases_argument_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's prefill runner calls ``capture_one(key, fn, <name>=None, post_warmup_hook=...)`` with
    the name its own base class declares (``dummies`` on 0.5.14-0.5.16, ``capture_inputs`` later):
    our subclass must take the call exactly as SGLang's own backend does, on every release."""
    import inspect

    from sglang.srt.model_executor.runner_backend.breakable_cuda_graph_backend import BreakableCudaGraphBackend

    third = list(inspect.signature(BreakableCudaGraphBackend.capture_one).parameters)[3]
    monkeypatch.setenv("SGLANG_ENABLE_BCG_SHARED_OUTPUT", "1")
    backend, model = make_backend(), Model()
    hooks: list[Any] = []
    with backend.capture_session(None):
        for n in (8, 4):
            key = shape_key(n)
            backend.capture_one(key, model.forward_for(key), **{third: None}, post_warmup_hook=lambda: hooks.append(n))
    assert hooks == [8, 8, 4, 4]
    with pytest.raises(TypeError, match="unexpected keyword argument 'inputs'"):
        backend.capture_one(shape_key(2), model.forward_for(shape_key(2)), inputs=None)
    with pytest.raises(TypeError, match="multiple values"):
        backend.capture_one(shape_key(2), model.forward_for(shape_key(2)), None, capture_inputs=None)


def test_capture_one_args_every_spelling() -> None:
    from sglang_bcg_plugin.sglang.compat import capture_one_args

    def hook() -> None:
        return None

    x = object()
    assert capture_one_args((), {}) == (None, None)
    assert capture_one_args((x, hook), {}) == (x, hook)
    assert capture_one_args((), {"dummies": x, "post_warmup_hook": hook}) == (x, hook)
    assert capture_one_args((x,), {"post_warmup_hook": hook}) == (x, hook)
    with pytest.raises(TypeError, match="at most 4"):
        capture_one_args((x, hook, 1), {})
    with pytest.raises(TypeError, match="multiple values"):
        capture_one_args((), {"dummies": x, "capture_inputs": x})
