"""The runner-seam hooks (SGLang 0.5.13) on any release, through a runner with 0.5.13's loop.

On 0.5.13 itself ``test_sglang_outputs.py`` drives SGLang's real ``BreakableCudaGraphRunner``.
Here the hooks run around :class:`Loop0513`, which repeats that release's ``_capture_all`` /
``_capture_one`` (largest first; two warmups of ``_run_forward``; the capture inside
``BreakableCUDAGraphCapture``; ``output_buffers[num_tokens] = output``) on the installed release's
segment engine, so the hooks' own logic is checked with every release CI runs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sglang_bcg_plugin.output import released as rel
from sglang_bcg_plugin.sglang import runner_seam

pytestmark = [pytest.mark.sglang, pytest.mark.usefixtures("cpu_bcg")]
ENV = "SGLANG_ENABLE_BCG_SHARED_OUTPUT"
SIZES = (16, 8, 4)


class Loop0513:
    """``BreakableCudaGraphRunner``'s capture loop as 0.5.13 writes it, with our hooks around it."""

    def __init__(self, engine: Any, outputs: Any) -> None:
        self.engine, self.make = engine, outputs
        self.model_runner = type("ModelRunner", (), {"server_args": None})()
        self.capture_num_tokens = sorted(SIZES)
        self.graphs: dict[int, Any] = {}
        self.output_buffers: dict[int, Any] = {}
        self.inputs = {n: torch.randn(n, 4) for n in SIZES}

    def _run_forward(self, forward_batch: Any, num_tokens: int) -> Any:
        return self.make(self.inputs[num_tokens] * 2)

    def _capture_all_original(self) -> None:
        for num_tokens in reversed(self.capture_num_tokens):
            graph, output = self._capture_one(num_tokens, (0, 0), None)
            self.graphs[num_tokens] = graph
            self.output_buffers[num_tokens] = output

    def _capture_one_original(self, num_tokens: int, pool: Any, stream: Any) -> Any:
        def run_once() -> Any:
            return self._run_forward(None, num_tokens)

        for _ in range(2):
            run_once()
        graph = self.engine.BreakableCUDAGraph()
        with self.engine.BreakableCUDAGraphCapture(cuda_graph=graph, pool=pool, stream=stream):
            output = run_once()
        return graph, output

    def _capture_all(self) -> None:
        runner_seam.around_capture_all(type(self)._capture_all_original, self)

    def _capture_one(self, num_tokens: int, pool: Any, stream: Any) -> Any:
        return runner_seam.around_capture_one(type(self)._capture_one_original, self, num_tokens, pool, stream)


@pytest.fixture
def loop(monkeypatch: pytest.MonkeyPatch) -> Any:
    from conftest import bcg_module

    engine = bcg_module()
    monkeypatch.setattr(runner_seam, "_capture_cls", lambda: engine.BreakableCUDAGraphCapture)
    monkeypatch.setattr(rel, "ALIAS_DEVICE_TYPES", frozenset({"cpu"}))
    monkeypatch.delenv("SGLANG_BCG_STALE_OUTPUT_GUARD", raising=False)
    return lambda make=(lambda h: h): Loop0513(engine, make)


@pytest.mark.parametrize("mode", ["on", "off", "released"])
def test_hooks_put_the_policy_around_the_loop(monkeypatch: pytest.MonkeyPatch, loop: Any, mode: str) -> None:
    monkeypatch.setenv(ENV, mode)
    runner = loop(lambda h: (h, None))
    runner._capture_all()  # private: the SGLang method the runner seam hooks
    report = runner_seam.runner_report(runner)
    assert [k.key.size for k in report.keys] == list(SIZES) and report.backend == "sglang-breakable"
    storages = {out[0].untyped_storage().data_ptr() for out in runner.output_buffers.values()}
    assert len(storages) == {"on": 1, "off": len(SIZES), "released": len(SIZES)}[mode]
    assert (report.resident_output_bytes == 0) is (mode == "released")
    for x in runner.inputs.values():
        x.copy_(torch.randn_like(x))
    from conftest import bcg_module

    for n in SIZES:
        with bcg_module().enable_breakable_cuda_graph() if hasattr(bcg_module(), "enable_breakable_cuda_graph") else _null():
            runner.graphs[n].replay()
        hidden, none = runner.output_buffers[n]
        torch.testing.assert_close(hidden, runner.inputs[n] * 2, rtol=0, atol=0)
        assert none is None
    assert "_run_forward" not in runner.__dict__  # the per-size shadow is gone


def _null() -> Any:
    import contextlib

    return contextlib.nullcontext()


def test_outside_capture_all_and_a_loop_that_never_captures(monkeypatch: pytest.MonkeyPatch, loop: Any) -> None:
    monkeypatch.setenv(ENV, "on")
    runner = loop()
    # private: _capture_one/_capture_all/_run_forward are the SGLang methods the runner seam hooks
    graph, output = runner._capture_one(4, (0, 0), None)  # not inside _capture_all: SGLang's own
    assert runner_seam.runner_report(runner) is None and output.shape == (4, 4)
    runner._run_forward = lambda fb, n: runner.inputs[n] + 1  # an instance's own forward is kept
    mine = runner.__dict__["_run_forward"]
    runner._capture_all()
    assert runner.__dict__["_run_forward"] is mine
    state = runner_seam.runner_state(runner)
    state.open(state.plan)
    try:
        with pytest.raises(RuntimeError, match="ran the forward 0 times"):
            runner_seam.around_capture_one(lambda self, n, pool, stream: (None, None), runner, 4, None, None)
    finally:
        state.close()
