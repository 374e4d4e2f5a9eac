"""The memory plan in a real SGLang server (docs/sglang.md#the-memory-plan), the invariants of
docs/benchmarks.md's table: ``scripts/server/memory_gap.py`` runs stock and the plan (``plan``:
``SGLANG_BCG_MEMORY_PLAN=1`` and ``--enable-bcg-shared-output``), one server after another, SGLang
sizing itself, under the adversarial load run to completion; then, with ``--mem-fraction-static``
pinned too high for the card, stock against the plan.

Needs a server bundle set up (``scripts/server/gpu-server-check.sh`` with
``SGLANG_BCG_SERVER_TESTS=tests/gpu/test_memory_plan_server_gpu.py``); Llama-3-8B's shapes by default
(``SGLANG_BCG_GAP_SHAPE``). Results: ``$SGLANG_BCG_GPU_RESULTS_DIR/memory-plan/``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from server_scripts import NEEDS_SERVER, load

SHAPE = os.environ.get("SGLANG_BCG_GAP_SHAPE", "llama3-8b")
#: A fraction that leaves the captures no room on an 80 GB or 141 GB card with the 8B shapes.
PINNED = os.environ.get("SGLANG_BCG_GAP_PINNED", "0.99")

pytestmark = NEEDS_SERVER


def _run(tmp_path_factory: pytest.TempPathFactory, name: str, variants: str, *extra: str) -> dict[str, Any]:
    gap, make = load("memory_gap"), load("make_model")
    out = Path(os.environ.get("SGLANG_BCG_GPU_RESULTS_DIR", tmp_path_factory.mktemp("gap"))) / "memory-plan" / name
    out.mkdir(parents=True, exist_ok=True)
    model = tmp_path_factory.getbasetemp() / f"model-{SHAPE}"
    if not (model / "config.json").exists():
        make.make_model(model, **make.SHAPES[SHAPE])
    args = gap.parse_args(["--model", str(model), "--plugin-path", os.environ["PLUGIN_SITE"], "--variants", variants,
                           "--out-dir", str(out), *extra])
    found = {}
    for variant in variants.split(","):
        found[variant] = result = gap.run_variant(args, variant, out)
        (out / f"memory-gap-{variant}.json").write_text(json.dumps(result, indent=1) + "\n")
        print(f"memory plan {name} {variant}: " + json.dumps({k: result.get(k) for k in (
            "kv_tokens", "unused_at_peak_gib", "unused_at_peak_kv_tokens", "failed", "died", "plan_vs_peak")}), flush=True)
    print(gap.format_table(gap.summary_rows(list(found.values()))), flush=True)
    return found


@pytest.fixture(scope="module")
def self_sized(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _run(tmp_path_factory, "self-sized", "stock,plan")


def test_the_plan_fills_what_stock_leaves_unused(self_sized: dict[str, Any]) -> None:
    stock, plan = self_sized["stock"], self_sized["plan"]
    for r in (stock, plan):
        assert r["ok"] and not r["died"] and r["failed"] == 0 and not r["oom"], r.get("log", {}).get("oom_lines")
    assert plan["greedy"] == stock["greedy"]
    assert plan["log"]["plan"]["backed_tokens"] == plan["kv_tokens"]
    assert plan["kv_tokens"] >= stock["kv_tokens"] + 0.8 * stock["unused_at_peak_kv_tokens"]
    assert abs(plan["plan_vs_peak"]) <= 0.02


def test_a_fraction_stock_cannot_start_on(tmp_path_factory: pytest.TempPathFactory) -> None:
    found = _run(tmp_path_factory, f"pinned-{PINNED}", "stock,plan", "--server-arg=--mem-fraction-static",
                 f"--server-arg={PINNED}", "--start-timeout", "240")
    stock, plan = found["stock"], found["plan"]
    if not stock["died"]:
        pytest.skip(f"stock started with --mem-fraction-static {PINNED} on this card: pick a higher fraction")
    assert stock["oom"] and not stock["log"]["captures"]  # it died before any capture ended
    assert plan["ok"] and not plan["died"] and plan["failed"] == 0 and not plan["oom"]
    assert "plan" in plan["log"] and abs(plan["plan_vs_peak"]) <= 0.02
