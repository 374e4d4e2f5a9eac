"""The memory plan's arithmetic, variables and lines (sglang_bcg_plugin/sglang/memory_plan.py), on the
figures recorded in a real 8B-shaped server (tests/data/server/memory-gap-h100-8b-*.json)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from sglang_bcg_plugin.sglang import memory_plan as mp
from sglang_bcg_plugin.sglang.memory_plan import GiB, MiB, MemoryPlan

DATA = Path(__file__).parent / "data" / "server"


def recorded(variant: str) -> dict:
    return json.loads((DATA / f"memory-gap-h100-8b-{variant}.json").read_text())


def plan(**kw) -> MemoryPlan:
    base = dict(total=80 * GiB, free=60 * GiB, weights=15 * GiB, forward=1 * GiB, forward_tokens=8192,
                logprobs=2 * GiB, logprob_tokens=2048, sampler=256 * MiB, margin=1 * GiB, kv_bytes_per_token=131072,
                guess=10 * GiB)
    return MemoryPlan(**{**base, **kw})


def test_parts_add_up() -> None:
    p = plan()
    assert p.eager == 3 * GiB + 256 * MiB
    assert p.reserve == p.eager + GiB
    assert p.kv_bytes == 60 * GiB - p.reserve
    assert p.kv_tokens == p.kv_bytes // 131072
    # everything but the margin: what is taken now, the KV pool, the eager working set
    assert p.planned_peak == p.total - p.margin
    assert plan(free=GiB).kv_bytes == 0 and plan(free=GiB).kv_tokens == 0
    assert plan(kv_bytes_per_token=0).kv_tokens == 0


def test_line_names_every_part() -> None:
    line = plan().line()
    assert line.startswith("sglang_bcg: memory plan: card 80.00 GiB = weights 15.00 GiB, graphs and buffers 5.00 GiB")
    for part in ("forward at 8192 tokens 1.00 GiB", "logprobs over 2048 tokens 2.00 GiB", "sampler 0.25 GiB",
                 "margin 1.00 GiB", f"KV 55.75 GiB = {plan().kv_tokens} tokens",
                 "SGLang's headroom 10.00 GiB: the KV pool 47104 tokens (5.75 GiB) larger than SGLang's"):
        assert part in line, part
    assert "weights, graphs and buffers 20.00 GiB" in plan(weights=0).line()
    assert line.endswith("larger than SGLang's")
    small = plan(guess=4 * GiB).line()
    assert small.endswith("SGLang's headroom 4.00 GiB is too small for the eager working set: the KV pool shrunk by "
                          "2048 tokens (0.25 GiB) to leave it room")
    assert plan(guess=4 * GiB, kv_bytes_per_token=0).against_sglang().endswith("shrunk by 0.25 GiB to leave it room")
    # the memory-gap harness counts a log line naming an out-of-memory as one: the plan's lines never do
    assert "out of memory" not in small.lower() and "out of memory" not in plan().after_line(1, 1).lower()
    after = plan().after_line(400_000, 5 * GiB)
    assert "KV backed 400000 tokens (48.83 GiB; planned 456704)" in after
    assert "free 5.00 GiB (planned: eager and margin 4.25 GiB); planned peak 79.00 GiB" in after


def test_the_recorded_server_leaves_more_kv_than_stock_and_post_capture() -> None:
    """The plan on the post-capture server's figures (free before the pool was backed) and stock's eager peak
    under the adversarial load (peak minus idle, what the plan's eager part must cover)."""
    stock, post = recorded("stock"), recorded("post-capture")
    free_before_backing = post["log"]["captures"][-1]["avail_after_gib"] * GiB
    eager_under_load = (stock["memory"]["peak_used_mib"] - stock["memory"]["idle_used_mib"]) * MiB
    p = plan(total=int(stock["memory"]["total_mib"] * MiB), free=int(free_before_backing), forward=int(eager_under_load),
             logprobs=0, sampler=0, margin=mp.margin_bytes({}), kv_bytes_per_token=stock["kv_bytes_per_token"])
    assert p.kv_tokens > stock["kv_tokens"] > post["kv_tokens"]
    # the unused memory at the peak it leaves is the margin, against stock's 6.98 GiB
    assert p.total - p.planned_peak == GiB < stock["unused_at_peak_gib"] * GiB


@pytest.mark.parametrize(("text", "expected"), [(None, 1024 * MiB), ("", 1024 * MiB), ("0", 0), (" 512 ", 512 * MiB)])
def test_margin(text, expected) -> None:
    assert mp.margin_bytes({} if text is None else {mp.ENV_MARGIN: text}) == expected


@pytest.mark.parametrize("text", ["-1", "1.5", "lots", "1e3"])
def test_margin_refused(text) -> None:
    with pytest.raises(ValueError, match=rf"{mp.ENV_MARGIN}=.*whole number of MiB \(default 1024\)"):
        mp.margin_bytes({mp.ENV_MARGIN: text})


def test_prepare_turns_post_capture_sizing_on() -> None:
    env = {mp.ENV_PLAN: "yes"}
    assert mp.prepare(env) is True and env[mp.ENV_POST_CAPTURE] == env[mp.ENV_FORECAST] == "1"
    env = {mp.ENV_PLAN: "1", mp.ENV_POST_CAPTURE: "0"}  # the operator's own value stays (the check refuses it)
    assert mp.prepare(env) is True and env[mp.ENV_POST_CAPTURE] == "0"
    for env in ({}, {mp.ENV_PLAN: "0"}, {mp.ENV_PLAN: "sometimes"}):
        assert mp.prepare(env) is False and mp.ENV_POST_CAPTURE not in env


def test_check_environment() -> None:
    mp.check_environment({})
    mp.check_environment({mp.ENV_PLAN: "1", mp.ENV_POST_CAPTURE: "1"})
    mp.check_environment({mp.ENV_PLAN: "0", mp.ENV_MARGIN: "lots"})  # off: its margin is not read
    with pytest.raises(ValueError, match=mp.ENV_PLAN):
        mp.check_environment({mp.ENV_PLAN: "sometimes"})
    with pytest.raises(ValueError, match=mp.ENV_MARGIN):
        mp.check_environment({mp.ENV_PLAN: "1", mp.ENV_MARGIN: "lots"})
    with pytest.raises(ValueError, match="SGLANG_ENABLE_POST_CAPTURE_KV_SIZING='off' turns off"):
        mp.check_environment({mp.ENV_PLAN: "1", mp.ENV_POST_CAPTURE: "off"})


def test_flag_check_exits_in_one_line(monkeypatch) -> None:
    import argparse

    from sglang_bcg_plugin.sglang.flag import after_from_cli_args

    monkeypatch.setenv(mp.ENV_PLAN, "1")
    monkeypatch.setenv(mp.ENV_MARGIN, "lots")
    with pytest.raises(SystemExit, match=r"^sglang_bcg: SGLANG_BCG_MEMORY_PLAN_MARGIN_MIB='lots'"):
        after_from_cli_args("args", object, argparse.Namespace())


class Runner:
    def __init__(self, active: bool | None) -> None:
        self.token_to_kv_pool = type("Pool", (), {} if active is None else {"post_capture_active": active})()


def test_not_applied_is_told_once(monkeypatch, caplog) -> None:
    monkeypatch.delenv(mp.ENV_PLAN, raising=False)
    assert mp.not_applied(Runner(False)) is None  # the plan not asked: nothing to say
    monkeypatch.setenv(mp.ENV_PLAN, "1")
    assert mp.not_applied(Runner(True)) is None
    why = mp.not_applied(Runner(None))
    assert why is not None and why.startswith("sglang_bcg: memory plan: not applied:") and "0.5.16" in why
    monkeypatch.setattr(mp, "_TOLD", set())
    with caplog.at_level(logging.WARNING, logger="sglang_bcg_plugin"):
        for _ in range(3):
            mp.tell_once(why)
        mp.tell_once(None)
    assert [r.getMessage() for r in caplog.records] == [why]


def test_the_hook_leaves_sglang_alone_without_the_plan(monkeypatch) -> None:
    calls = []
    monkeypatch.delenv(mp.ENV_PLAN, raising=False)
    assert mp.around_post_capture_resize(lambda r, *a, **k: calls.append((r, a, k)) or "sized", "runner", 1,
                                         draft_runners=()) == "sized"
    assert calls == [("runner", (1,), {"draft_runners": ()})]
    monkeypatch.setenv(mp.ENV_PLAN, "1")  # asked, but no CUDA here: SGLang's own sizing
    assert mp.around_post_capture_resize(lambda r, *a, **k: "sized", "runner") == "sized"


def test_eager_peaks_measure_nothing_without_cuda(monkeypatch) -> None:
    monkeypatch.setenv(mp.ENV_PLAN, "1")
    peaks = mp.EagerPeaks()
    with peaks.measuring(8192):
        pass
    assert (peaks.bytes, peaks.tokens) == (0, 0)


def test_kv_bytes_per_token_from_the_pool_buffers() -> None:
    import torch

    pool = type("Pool", (), {"k_buffer": [torch.zeros(10, 8, 128, dtype=torch.bfloat16)] * 32,
                             "v_buffer": [torch.zeros(10, 8, 128, dtype=torch.bfloat16)] * 32})()
    assert mp.kv_bytes_per_token(type("R", (), {"token_to_kv_pool": pool})()) == 131072
    assert mp.kv_bytes_per_token(object()) == 0


def test_lm_head_weight() -> None:
    import torch

    head = torch.nn.Linear(4, 10, bias=False)
    assert mp.lm_head_weight(type("M", (), {"lm_head": head})()) is head.weight
    tied = type("M", (), {"model": type("I", (), {"embed_tokens": torch.nn.Embedding(10, 4)})()})()
    assert mp.lm_head_weight(tied) is tied.model.embed_tokens.weight
    assert mp.lm_head_weight(object()) is None


def test_the_doctor_line(monkeypatch) -> None:
    from sglang_bcg_plugin.sglang import doctor

    assert doctor.plan_line("backend", {}).startswith("off (SGLANG_BCG_MEMORY_PLAN=''); SGLANG_BCG_MEMORY_PLAN=1 backs")
    assert doctor.plan_line("backend", {mp.ENV_PLAN: "maybe"}).startswith("invalid (SGLANG_BCG_MEMORY_PLAN=")
    assert "not applied" in doctor.plan_line("runner", {mp.ENV_PLAN: "1"})
    monkeypatch.setattr(doctor, "has_post_capture_sizing", lambda: False)
    assert "not applied" in doctor.plan_line("backend", {mp.ENV_PLAN: "1"})
    monkeypatch.setattr(doctor, "has_post_capture_sizing", lambda: True)
    assert doctor.plan_line("backend", {mp.ENV_PLAN: "1"}).startswith("on: after capture, 'sglang_bcg: memory plan")


def test_tensor_parallel_ranks_hold_back_the_largest(monkeypatch) -> None:
    import torch

    from sglang_bcg_plugin.sglang.compat import tp_agree

    assert tp_agree(5, largest=True) == 5  # no TP group initialized here
    other_rank = 7

    def all_reduce(tensor, op, group):
        assert op == torch.distributed.ReduceOp.MAX and group == "gloo-group"
        tensor.fill_(max(int(tensor.item()), other_rank))

    fake = type("PS", (), {"get_tp_group": staticmethod(lambda: type("G", (), {"world_size": 2,
                                                                                "cpu_group": "gloo-group"})())})
    from sglang_bcg_plugin.sglang import compat

    real_import = compat.importlib.import_module
    monkeypatch.setattr(compat.importlib, "import_module",
                        lambda name: fake if name.endswith("parallel_state") else real_import(name))
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    assert tp_agree(5, largest=True) == 7 and tp_agree(9, largest=True) == 9


def test_graphs_still_to_capture_are_held_back() -> None:
    p = plan(pending_graphs=2 * GiB)
    assert p.reserve == p.eager + 2 * GiB + GiB and p.kv_bytes == 60 * GiB - p.reserve
    assert p.planned_peak == p.total - p.margin
    assert "+ prefill graphs still to capture 2.00 GiB (forecast) + margin 1.00 GiB" in p.line()
    assert "still to capture" not in plan().line()


def test_pending_graph_bytes_from_the_forecast() -> None:
    from types import SimpleNamespace as NS

    from sglang_bcg_plugin.sglang import incremental as inc

    forecast = NS(mode="on", forecast={"modes": {"on": NS(total_bytes=3 * GiB)}}, held_at_start=0,
                  _pool_bytes=lambda: GiB)
    runner = NS(backend=NS(_bcg_forecast=forecast))
    assert mp.pending_graph_bytes(runner) == 0  # not incremental
    runner.__dict__[inc.STATE_ATTR] = inc.Pending([16, 8], total=3)
    assert mp.pending_graph_bytes(runner) == 2 * GiB  # the schedule's forecast less the pool so far
    forecast.mode = "off"
    assert mp.pending_graph_bytes(runner) == 0  # no forecast of that mode
    assert mp.pending_graph_bytes(None) == 0
