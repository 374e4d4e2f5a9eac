"""Incremental capture (sglang_bcg_plugin/sglang/incremental.py) on the installed release's own breakable
backend (our subclass, the CPU graph stand-in of ``cpu_bcg``), in every output mode.

Stood in: SGLang's ``PrefillCudaGraphRunner`` (it needs a real ModelRunner): :class:`PrefillRunner` has the
three members the hooks use, in SGLang's shape (``capture()`` opens the backend's session and runs
``_capture_one_stream``, which captures ``capture_num_tokens`` largest first; ``can_run_graph`` says yes up
to the largest size; ``_pad_to_bucket`` is SGLang's own); the test checks those members exist on the real
class with these signatures. The scheduler is stood in by what ``step`` reads (``tp_worker.model_runner``,
``running_batch``, ``waiting_queue``). Checked: start-up captures the largest size alone; a batch whose
bucket is not captured yet runs eagerly; each step captures the next size, largest first, sharing the first
session's buffer under ``on``; every replay equals an eager forward after the inputs changed; the pace
under load; TP ranks capture only when all agree; a failed step leaves the rest eager and the server up."""

from __future__ import annotations

import inspect
import re
from types import SimpleNamespace as NS
from typing import Any

import pytest
import torch

from seam_drivers import close, storages
from sglang_bcg_plugin.output import released as rel
from sglang_bcg_plugin.sglang import incremental as inc
from sglang_bcg_plugin.sglang import serving_capture as sc

pytestmark = [pytest.mark.sglang, pytest.mark.usefixtures("cpu_bcg")]
#: 0.5.13 has no prefill runner of this shape (its breakable runner captures everything itself)
needs_seam = pytest.mark.skipif(not inc.has_runner_seam(), reason="no PrefillCudaGraphRunner seam (SGLang 0.5.13)")

HIDDEN = 8
SIZES = [4, 8, 16, 32]  # SGLang's capture_num_tokens order: ascending
ENV = "SGLANG_ENABLE_BCG_SHARED_OUTPUT"


def real_runner_class() -> Any:
    import importlib

    return getattr(importlib.import_module(inc.RUNNER_CLASS.rpartition(".")[0]), inc.RUNNER_CLASS.rpartition(".")[2])


class PrefillRunner:
    """SGLang's prefill runner as the hooks see it (stand-in: module doc)."""

    def __init__(self, model: Model, monkeypatch: pytest.MonkeyPatch) -> None:
        from cpu_graph_standin import FakeRunner
        from sglang_bcg_plugin.sglang import sglang_breakable_backend_class

        self.model, self.capture_num_tokens, self.stream = model, list(SIZES), None
        self.backend = sglang_breakable_backend_class()(FakeRunner())
        self._pad_to_bucket = real_runner_class()._pad_to_bucket  # SGLang's own (a staticmethod)
        self.fail_on: int | None = None
        self.model_runner = NS(req_to_token_pool=NS(mamba_pool=None))
        #: per capture pass: whether the real runner classes' capture batches write into the padding slot
        self.padded: list[bool] = []

    def capture(self) -> None:  # SGLang: model_context, warmup, graph_capture, backend.capture_session
        from sglang_bcg_plugin.sglang.serving_capture import runner_classes

        self.padded.append(all(hasattr(c.__dict__["capture_prepare"], "__wrapped__") for c in runner_classes()))
        with self.backend.capture_session(self.stream):
            inc.around_capture_one_stream(type(self)._capture_one_stream, self)

    def _capture_one_stream(self) -> None:
        from sglang.srt.model_executor.runner.shape_key import ShapeKey

        for n in reversed(self.capture_num_tokens):
            if n == self.fail_on:
                raise RuntimeError(f"CUDA out of memory capturing {n}")
            self.backend.capture_one(ShapeKey(size=n), self.model.forward_for(n))

    def can_run_graph(self, forward_batch: Any) -> bool:
        return inc.around_can_run_graph(lambda r, fb: len(fb.input_ids) <= max(r.capture_num_tokens), self,
                                        forward_batch)

    def replay(self, n: int) -> Any:
        from sglang.srt.model_executor.runner.shape_key import ShapeKey

        with self.backend.replay_session():
            return self.backend.replay(ShapeKey(size=n), None)


class Model:
    def __init__(self) -> None:
        from conftest import eager_break

        self.w = torch.randn(HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(0))
        self.inputs: dict[int, torch.Tensor] = {}
        self.attention = eager_break(lambda h: torch.tanh(h))

    def forward_for(self, n: int) -> Any:
        x = self.inputs.setdefault(n, torch.randn(n, HIDDEN))
        return lambda: (self.attention(x @ self.w) * 2, None)

    def expected(self, n: int) -> Any:
        return (torch.tanh(self.inputs[n] @ self.w) * 2, None)

    def refill(self) -> None:
        for x in self.inputs.values():
            x.copy_(torch.randn_like(x))


def scheduler(runner: PrefillRunner, busy: bool = False) -> Any:
    running = NS(is_empty=lambda: not busy)
    return NS(tp_worker=NS(model_runner=NS(prefill_cuda_graph_runner=runner)), running_batch=running,
              waiting_queue=[])


def unpaced(runner: PrefillRunner) -> inc.Pending:
    """The runner's state as if its start-up capture had taken no time: every step due at once."""
    state = inc.pending(runner)
    state.last_end = state.last_seconds = state.last_busy = 0.0
    state.last_count, state.served_from, state.serving_since = 0, None, 0.0
    return state


def batch(tokens: int) -> Any:
    return NS(input_ids=torch.zeros(tokens, dtype=torch.int64))


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (ENV, "SGLANG_BCG_SHARED_BUFFER", "SGLANG_BCG_STALE_OUTPUT_GUARD", "SGLANG_ENABLE_GRAPH_POOL_BORROW"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(inc.ENV_INCREMENTAL, "1")
    monkeypatch.setattr(rel, "ALIAS_DEVICE_TYPES", frozenset({"cpu"}))  # the stand-in keeps segment storage


@needs_seam
def test_the_stand_in_has_the_real_runner_s_members() -> None:
    real = real_runner_class()
    assert list(inspect.signature(real._capture_one_stream).parameters) == ["self"]
    assert list(inspect.signature(real.capture).parameters) == ["self"]
    assert list(inspect.signature(real.can_run_graph).parameters)[:2] == ["self", "forward_batch"]
    assert real._pad_to_bucket(5, SIZES) == 8 and inc.has_runner_seam()


@pytest.mark.parametrize("mode", ["on", "off", "released"])
@needs_seam
def test_sizes_captured_between_batches_largest_first(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    monkeypatch.setenv(ENV, mode)
    model = Model()
    runner = PrefillRunner(model, monkeypatch)
    runner.capture()  # start-up
    assert sorted(k.size for k in runner.backend._graphs) == [32] and inc.pending_sizes(runner) == [16, 8, 4]
    assert runner.capture_num_tokens == SIZES  # the runner's own list is left whole
    assert inc.switch_running(runner) is None  # start-up's sizes: a switch may come while they are captured
    assert runner.can_run_graph(batch(20)) and runner.can_run_graph(batch(32))  # bucket 32: captured
    assert not runner.can_run_graph(batch(5)) and not runner.can_run_graph(batch(16))  # pending: eager
    assert not runner.can_run_graph(batch(33))  # SGLang's own answer stands
    busy = scheduler(runner, busy=True)  # under load: one size per step
    unpaced(runner)
    clock = iter([0.0, 0.0, 1.0, 1.0, 2.0, 2.0]).__next__  # steps that take no time: each due at once
    captured = [inc.step(busy, clock) for _ in range(3)]
    assert captured == [[16], [8], [4]] and inc.pending_sizes(runner) == [] and inc.step(busy) is None
    assert runner.padded == [False, True, True, True]  # the steps' batches write KV into the padding slot
    assert all(runner.can_run_graph(batch(n)) for n in (1, 5, 16, 32))
    model.refill()
    for n in SIZES:
        close(runner.replay(n), model.expected(n))
    outs = list(runner.backend._outputs.values())
    report = runner.backend.memory_report()
    assert runner.backend.last_output_mode.mode == mode and len(report.keys) == 4
    if mode == "on":  # the later sessions copied into the first session's buffer
        assert len(storages(outs)) == 1 and all(k.shared for k in report.keys)
    elif mode == "off":
        assert len(storages(outs)) == 4
    else:
        assert report.resident_output_bytes == 0
    described = inc.pending(runner).describe()
    assert described.pop("slowest_step_per_size_s") >= 0
    assert described == {"captured": 4, "sizes": 4, "pending_sizes": [], "decode_pending": False, "by_switch": False,
                         "capture_failed": None}


@needs_seam
def test_under_load_a_step_waits_as_long_as_the_last_capture_took(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    runner = PrefillRunner(Model(), monkeypatch)
    before = time.perf_counter()
    runner.capture()
    state = inc.pending(runner)  # the start-up capture paces the first step
    assert before <= state.last_end - state.last_seconds and state.last_end <= time.perf_counter()
    assert state.last_count == 1 and state.slowest == state.last_seconds > 0
    state.last_end = state.last_busy = 8.0  # the largest size took 2 s, ended at 8 s
    state.last_seconds = 2.0
    busy, idle = scheduler(runner, busy=True), scheduler(runner)
    assert inc.step(idle, lambda: 9.0) is None  # idle for 1 s: not yet
    clock = iter([9.5,  # the first batch: served from here, not from the capture's end
                  10.5,  # 1 s of serving: not due
                  11.5, 13.5,  # 2 s: due; the step took 2 s
                  14.0,  # served from here
                  16.0, 16.5,  # 2 s: due; it took 0.5 s
                  16.6]).__next__  # served from here
    assert [inc.step(busy, clock) for _ in range(5)] == [None, None, [16], None, [8]]
    assert inc.step(busy, clock) is None
    assert inc.step(idle, lambda: 16.7) is None  # a gap between batches is not idle
    assert inc.step(idle, iter([17.1, 17.2]).__next__) == [4]  # no request for as long as the last step took
    assert state.slowest >= 2.0


@needs_seam
def test_tp_ranks_capture_only_together(monkeypatch: pytest.MonkeyPatch) -> None:
    runner = PrefillRunner(Model(), monkeypatch)
    runner.capture()
    votes = []

    def all_reduce(tensor: torch.Tensor, op: Any, group: Any) -> None:
        assert op == torch.distributed.ReduceOp.MIN and group == "gloo"
        votes.append(int(tensor.item()))
        tensor.fill_(min(int(tensor.item()), other[0]))

    other = [0]
    from sglang_bcg_plugin.sglang import compat

    monkeypatch.setattr(compat, "tp_group", lambda: NS(cpu_group="gloo"))
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    unpaced(runner)
    assert inc.step(scheduler(runner)) is None and votes == [1]  # this rank wants one, the other none yet
    other[0] = 1
    assert inc.step(scheduler(runner)) == [16]
    state = inc.pending(runner)
    state.last_seconds, state.last_count = 0.1, 1  # idle, this rank's pace fits both sizes left in a step
    assert state.wanted(True, 0.05) == 0 and state.wanted(True, 1.0) == 2
    assert inc.step(scheduler(runner)) == [8] and votes[-1] == 2  # the other rank wants one: the fewest
    other[0] = 9
    assert inc.step(scheduler(runner)) == [4] and inc.pending_sizes(runner) == []


@needs_seam
def test_a_failed_step_leaves_the_rest_eager(monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    model = Model()
    runner = PrefillRunner(model, monkeypatch)
    runner.capture()
    runner.fail_on = 8
    unpaced(runner)
    busy = scheduler(runner, busy=True)
    assert inc.step(busy, iter([0.0, 0.0]).__next__) == [16]
    assert inc.step(busy, iter([0.0, 0.0]).__next__) is None
    state = inc.pending(runner)
    assert state.failed == "RuntimeError: CUDA out of memory capturing 8" and inc.pending_sizes(runner) == [8, 4]
    assert "incremental capture of prefill sizes [8] failed; 2 prefill sizes stay eager" in caplog.text
    assert not runner.can_run_graph(batch(5)) and runner.can_run_graph(batch(12))
    assert inc.step(scheduler(runner)) is None  # no retry
    model.refill()
    close(runner.replay(16), model.expected(16))


@needs_seam
def test_an_idle_server_captures_what_fits_in_a_step(monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    import logging

    model = Model()
    runner = PrefillRunner(model, monkeypatch)
    runner.capture_num_tokens = list(range(4, 4 * 26, 4))  # 25 sizes
    runner.capture()
    state = unpaced(runner)
    assert state.wanted(True, 0.0) == 1  # no pace yet: one
    state.last_seconds, state.last_count = 0.2, 2  # 0.1 s a size: five fit in IDLE_STEP_S
    with caplog.at_level(logging.INFO, logger="sglang_bcg_plugin"):
        assert inc.step(scheduler(runner), iter([1.0, 1.5]).__next__) == [96, 92, 88, 84, 80]
        while inc.step(scheduler(runner)):
            pass
    assert inc.pending_sizes(runner) == [] and sorted(k.size for k in runner.backend._graphs) == runner.capture_num_tokens
    assert re.search(r"incremental capture: 1\d of 25 prefill sizes captured \(down to \d+ tokens\)", caplog.text)
    assert "incremental capture: all 25 prefill sizes captured" in caplog.text
    model.refill()
    for n in (4, 52, 100):
        close(runner.replay(n), model.expected(n))


@needs_seam
def test_off_without_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(inc.ENV_INCREMENTAL)
    runner = PrefillRunner(Model(), monkeypatch)
    runner.capture()
    assert sorted(k.size for k in runner.backend._graphs) == SIZES and inc.pending(runner) is None
    assert inc.step(scheduler(runner)) is None and runner.can_run_graph(batch(5))
    monkeypatch.setenv(inc.ENV_INCREMENTAL, "sometimes")  # unreadable: off here (the launch check names it)
    assert not inc.asked()
    with pytest.raises(ValueError, match=inc.ENV_INCREMENTAL):
        inc.incremental_enabled()


APPLY = """
import os, logging, io
os.environ["SGLANG_BCG_INCREMENTAL_CAPTURE"] = "1"
stream = io.StringIO()
logging.getLogger().addHandler(logging.StreamHandler(stream))
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang_bcg_plugin.sglang import incremental as inc
from sglang_bcg_plugin.sglang import serving_capture as sc
load_plugins()
targets = (inc.START_TARGET, inc.CAPTURE_TARGET, inc.CAN_RUN_TARGET, inc.STEP_TARGET)
report(registered=[t in HookRegistry._hooks for t in targets], patched=[t in HookRegistry._patched for t in targets],
       seam=inc.has_runner_seam(), failed="Failed to apply" in stream.getvalue())
"""


@pytest.mark.slow
def test_load_plugins_applies_the_hooks_where_asked(dist_dir: Any) -> None:
    from conftest import run_child

    r = run_child(APPLY, dist_dir).result
    assert r["registered"] == r["patched"] == [r["seam"]] * 4 and not r["failed"]


def test_the_doctor_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang_bcg_plugin.sglang import doctor

    assert doctor.incremental_line("backend", {}).startswith("off (SGLANG_BCG_INCREMENTAL_CAPTURE='')")
    assert doctor.incremental_line("backend", {inc.ENV_INCREMENTAL: "x"}).startswith("invalid (")
    assert "not applied" in doctor.incremental_line("runner", {inc.ENV_INCREMENTAL: "1"})
    monkeypatch.setattr(doctor, "has_runner_seam", lambda: True)
    assert doctor.incremental_line("backend", {inc.ENV_INCREMENTAL: "1"}).startswith("on: ")


@needs_seam
def test_a_step_freezes_objects_as_sglang_does_without_its_two_collections(monkeypatch: pytest.MonkeyPatch) -> None:
    """The release's prefill runner module imports ``freeze_gc`` by name; in a step it is swapped for one that
    freezes and unfreezes without ``gc.collect()``, and restored after, also when the capture raises."""
    import gc
    import sys

    real = real_runner_class()
    module = sys.modules[real.__module__]
    original, runner = module.freeze_gc, real.__new__(real)
    collected, frozen = [], []
    monkeypatch.setattr(gc, "collect", lambda *a: collected.append(a) or 0)
    monkeypatch.setattr(gc, "freeze", lambda: frozen.append("freeze"))
    monkeypatch.setattr(gc, "unfreeze", lambda: frozen.append("unfreeze"))
    with sc.light_gc(runner):
        assert module.freeze_gc is not original
        with module.freeze_gc(False):
            assert frozen == ["freeze"]
        with module.freeze_gc(True):  # SGLang's GC enabled during capture: nothing frozen
            pass
    assert module.freeze_gc is original and frozen == ["freeze", "unfreeze"] and collected == []
    with pytest.raises(RuntimeError), sc.light_gc(runner):
        raise RuntimeError("capture failed")
    assert module.freeze_gc is original
    with original(False):  # SGLang's own collects twice
        pass
    assert len(collected) == 2
    with sc.light_gc(object()):  # a runner whose module has no freeze_gc: nothing changed
        pass
    with sc.light_gc(real, runner):  # a class or an instance; its module swapped once, restored once
        assert module.freeze_gc is not original
    assert module.freeze_gc is original


@needs_seam
def test_only_a_start_up_capture_that_leaves_sizes_for_later_skips_sglang_s_collections(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner's ``capture`` (hooked) at start-up, where sizes are left for later, runs the release's
    ``freeze_gc`` (looked up in its module by name, as SGLang's ``capture`` does) without its two collections; a
    capture of one size, a model with per-request state, a step, a live switch and a server that did not ask run
    SGLang's own, with both collections."""
    import gc
    import sys

    module = sys.modules[real_runner_class().__module__]
    collected: list[Any] = []
    monkeypatch.setattr(gc, "collect", lambda *a: collected.append(a) or 0)

    def capture(runner: Any) -> str:  # SGLang's capture: freeze_gc read from its module when it runs
        with module.freeze_gc(False):
            return "captured"

    def collections(runner: Any) -> int:
        collected.clear()
        assert inc.around_capture(capture, runner) == "captured"
        return len(collected)

    runner = PrefillRunner(Model(), monkeypatch)
    original = module.freeze_gc
    assert collections(runner) == 0 and module.freeze_gc is original  # start-up: restored after
    runner.capture_num_tokens = [SIZES[0]]
    assert collections(runner) == 2  # one size: nothing left for later
    runner.capture_num_tokens = list(SIZES)
    runner.model_runner = NS(req_to_token_pool=NS(mamba_pool=object()))
    assert collections(runner) == 2  # per-request state: every size now
    runner.model_runner = NS(req_to_token_pool=NS(mamba_pool=None))
    with inc.switching():
        assert collections(runner) == 2  # a live switch (its while_serving skips them itself)
    runner.capture()  # start-up: the largest size; the rest pending
    assert collections(runner) == 2  # a later pass (a step's, run inside while_serving) is SGLang's own here
    monkeypatch.setenv(inc.ENV_INCREMENTAL, "0")
    assert collections(PrefillRunner(Model(), monkeypatch)) == 2


@needs_seam
def test_a_model_with_per_request_state_captures_everything_at_start_up(monkeypatch: pytest.MonkeyPatch,
                                                                        caplog: Any) -> None:
    """A capture while serving would clear a live request's mamba state: such a model captures every size at once."""
    runner = PrefillRunner(Model(), monkeypatch)
    runner.model_runner = NS(req_to_token_pool=NS(mamba_pool=object()))
    with caplog.at_level("WARNING", logger="sglang_bcg_plugin"):
        runner.capture()
    assert sorted(k.size for k in runner.backend._graphs) == SIZES and inc.pending(runner) is None
    assert "incremental capture is off for this model: it keeps a mamba state pool" in caplog.text


@pytest.mark.parametrize("mode", ["on", "off", "released"])
@needs_seam
def test_a_live_switch_captures_no_size_and_the_steps_capture_them_all(monkeypatch: pytest.MonkeyPatch,
                                                                       mode: str) -> None:
    """Under :func:`inc.switching` the new runner captures nothing (every batch eager); the steps capture the
    largest first, in a session that starts the output policy as a fresh capture would (``released``: the largest
    keeps its output; ``on``: one shared buffer), and every replay equals an eager forward."""
    monkeypatch.setenv(ENV, mode)
    model, fresh = Model(), PrefillRunner(Model(), monkeypatch)
    monkeypatch.delenv(inc.ENV_INCREMENTAL)
    fresh.capture()  # every size at once: the reference
    monkeypatch.setenv(inc.ENV_INCREMENTAL, "1")
    runner = PrefillRunner(model, monkeypatch)
    start = 0.0
    with inc.switching():
        runner.capture()
    inc.paced_from(runner, start, now=lambda: 2.5)
    state = inc.pending(runner)
    assert not runner.backend._graphs and state.sizes == [32, 16, 8, 4] and (state.last_end, state.last_seconds) == (2.5, 2.5)
    assert state.by_switch and inc.switch_running(runner) is not None  # another switch waits for these sizes
    assert runner.backend.last_output_mode.mode == mode and not any(runner.can_run_graph(batch(n)) for n in SIZES)
    assert state.wanted(idle=True, now=4.0) == 0 and state.wanted(idle=True, now=5.0) == 1  # idle as long first
    state.note(idle=False, now=3.0)
    assert state.wanted(idle=False, now=5.0) == 0 and state.wanted(idle=False, now=5.5) == 1  # or served as long
    unpaced(runner)
    clock = iter([float(t // 2) for t in range(8)]).__next__  # steps that take no time
    captured = [inc.step(scheduler(runner, busy=True), clock) for _ in range(4)]
    assert captured == [[32], [16], [8], [4]] and runner.padded == [False, True, True, True, True]
    model.refill()
    for n in SIZES:
        close(runner.replay(n), model.expected(n))
    got, want = runner.backend.memory_report(), fresh.backend.memory_report()
    def rows(report: Any) -> list[tuple[int, int, int, bool, str | None]]:
        return sorted((k.key.size, k.logical_output_bytes, k.resident_output_bytes, k.shared, k.fallback)
                      for k in report.keys)

    assert rows(got) == rows(want)
    assert got.resident_output_bytes == want.resident_output_bytes
    assert len(storages(list(runner.backend._outputs.values()))) == len(storages(list(fresh.backend._outputs.values())))
    assert len(storages(list(runner.backend._outputs.values()))) == {"on": 1, "off": 4}.get(mode, 4)
    assert inc.switch_running(runner) is None  # every size captured: the switch has ended
    inc.paced_from(runner, start)  # sizes captured: the pace is the steps' own
    assert inc.pending(runner).last_end != 2.5


@needs_seam
def test_the_start_up_line_says_how_long_the_largest_size_took_and_where(monkeypatch: pytest.MonkeyPatch,
                                                                          caplog: Any) -> None:
    """What incremental capture does before serving, timed by phase: the release's warm-ups, the capture, the
    forecast after it (the start-up's whole cost before the first answer)."""
    import logging

    runner = PrefillRunner(Model(), monkeypatch)
    with caplog.at_level(logging.INFO, logger="sglang_bcg_plugin"):
        runner.capture()
    timed = runner.backend._bcg_last_phases
    assert list(timed) == ["warmups", "capture", "forecast"] and all(s >= 0 for s in timed.values())
    state = inc.pending(runner)
    assert sum(timed.values()) <= state.last_seconds
    m = re.search(r"the largest prefill size \(32 tokens\) captured in ([\d.]+) s \(warm-ups [\d.]+ s, "
                  r"capture [\d.]+ s, forecast [\d.]+ s\); 3 more between batches", caplog.text)
    assert m and float(m.group(1)) == pytest.approx(state.last_seconds, abs=0.01), caplog.text
    assert inc.phases(NS(backend=NS())) == "" and inc.phases(None) == ""


@needs_seam
def test_the_first_step_is_paced_from_serving_and_no_step_starts_the_forecast(monkeypatch: pytest.MonkeyPatch) -> None:
    """An idle server's first step waits as long as the largest size took from when serving began, not from the
    capture's end. No step hands the first capture's forecast to its thread (beside the steps it held them for the
    GIL): the session's close after the last size does, or a failed step (no close comes)."""
    runner = PrefillRunner(Model(), monkeypatch)
    runner.capture()
    state, calls = inc.pending(runner), []
    monkeypatch.setattr(runner.backend._bcg_forecast, "in_background", lambda: calls.append(len(state.sizes)))
    state.last_end = state.last_busy = 5.0  # the largest size took 2 s, ended at 5 s
    state.last_seconds = 2.0
    idle = scheduler(runner)
    assert inc.step(idle, lambda: 8.0) is None  # 3 s after the capture, but serving only now
    assert state.serving_since == 8.0 and state.last_busy == 8.0
    assert inc.step(idle, lambda: 9.9) is None
    assert inc.step(idle, iter([10.0, 10.1]).__next__) == [16] and calls == []
    monkeypatch.setattr(runner, "capture", lambda: (_ for _ in ()).throw(RuntimeError("CUDA out of memory")))
    assert inc.step(idle, iter([20.0, 20.1]).__next__) is None and state.failed and calls == [len(state.sizes)]


@needs_seam
def test_the_session_closes_in_the_last_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first session's forecast is closed (its after-capture line) once, at the end of the step that captures the
    last sizes: during that step no size is left beyond the ones it captures."""
    from sglang_bcg_plugin.sglang.forecast_log import SessionForecast

    closed: list[list[int]] = []
    runner = PrefillRunner(Model(), monkeypatch)
    monkeypatch.setattr(SessionForecast, "close", lambda self, *a: closed.append(sorted(k.size for k in runner.backend._graphs)))
    runner.capture()
    # the backend's runner is SGLang's prefill runner, which holds the state (the stand-in's backend has its own)
    runner.backend._cuda_graph_runner.__dict__[inc.STATE_ATTR] = inc.pending(runner)
    closed.clear()
    assert inc.pending_sizes(runner) == [16, 8, 4]
    state = unpaced(runner)
    state.current = [16]
    assert inc.pending_sizes(runner) == [8, 4]  # what is left beyond the running step
    state.current = None
    busy = scheduler(runner, busy=True)
    clock = iter([0.0, 0.0, 1.0, 1.0, 2.0, 2.0]).__next__
    assert [inc.step(busy, clock) for _ in range(2)] == [[16], [8]] and closed == []
    assert inc.step(busy, clock) == [4] and closed == [[4, 8, 16, 32]]
