"""A real SGLang server on the GPU: ``launch_server`` with SGLang's own ModelRunner, Llama, prefill
breakable CUDA graph, scheduler, tokenizer and HTTP server, stock against the plugin.

Each variant is its own server process, one after another (graph memory is read from free
device memory, so never two at once), driven by ``scripts/server/server_check.py``: ``stock``
(plugin not importable), ``default`` (installed, nothing set), and ``--enable-bcg-shared-output``
as ``on``, ``off`` and ``released``. Needs a server bundle set up (``scripts/server/setup.sh``
exports ``PLUGIN_SITE``; ``scripts/server/gpu-server-check.sh`` does all of it); skipped
otherwise. ``SGLANG_BCG_SERVER_SHAPE=llama3-8b`` runs Llama-3-8B's shapes with 16384-token
chunks; ``SGLANG_BCG_SERVER_VARIANTS`` picks variants (``stock`` always runs: it is the
reference). Results: ``$SGLANG_BCG_GPU_RESULTS_DIR/sglang_server_<shape>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import pytest
from server_scripts import NEEDS_SERVER, load

SHAPE = os.environ.get("SGLANG_BCG_SERVER_SHAPE", "tiny")
CHUNK = {"tiny": 4096, "llama3-8b": 16384}
#: Variants whose prefill and decode throughput is measured (ratios to stock).
THROUGHPUT = ("stock", "on", "released")
#: SGLang's "mem usage" line has 0.01 GB resolution.
RESOLUTION_GB = 0.01

pytestmark = NEEDS_SERVER



def _variants() -> list[str]:
    asked = [v.strip() for v in os.environ.get("SGLANG_BCG_SERVER_VARIANTS", "").split(",") if v.strip()]
    chosen = asked or ["stock", "on", "released", "off", "default"]
    return ["stock", *[v for v in chosen if v != "stock"]]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    check, make = load("server_check"), load("make_model")
    out = Path(os.environ.get("SGLANG_BCG_GPU_RESULTS_DIR", tmp_path_factory.mktemp("server")))
    out.mkdir(parents=True, exist_ok=True)
    model = make.make_model(tmp_path_factory.mktemp("model") / SHAPE, **make.SHAPES[SHAPE])
    found: dict[str, dict[str, Any]] = {}
    for variant in _variants():
        args = argparse.Namespace(
            model=str(model), variant=variant, plugin_path=os.environ["PLUGIN_SITE"],
            chunked_prefill_size=CHUNK[SHAPE], mem_fraction_static=0.3 if SHAPE == "tiny" else 0.5,
            max_total_tokens=131072, server_arg=[], throughput=variant in THROUGHPUT, completions=True,
            start_timeout=600.0, timeout=300.0, log=str(out / f"server-{SHAPE}-{variant}.log"))
        found[variant] = check.run_variant(args)
        print(f"server {SHAPE} {variant}: " + json.dumps({k: v for k, v in found[variant].items()
                                                         if k not in ("outs", "batch", "log_tail")}), flush=True)
        (out / f"sglang_server_{SHAPE}.json").write_text(json.dumps(found, indent=1) + "\n")
    return found


def _ok(results: dict[str, dict[str, Any]], variant: str) -> dict[str, Any]:
    r = results[variant]
    assert r["ok"], f"{variant}: {r.get('error')}\n{r.get('log_tail', '')}"
    return r


def test_every_variant_serves(results: dict[str, dict[str, Any]]) -> None:
    for variant in results:
        r = _ok(results, variant)
        assert isinstance(r["completion"], str)
        assert "prefill_mem_gb" in r, f"{variant}: no prefill capture line (was the prefill graph captured?)"


def test_greedy_ids_are_stock_sglangs_in_every_variant(results: dict[str, dict[str, Any]]) -> None:
    stock = _ok(results, "stock")
    assert len(stock["outs"]) == len(stock["batch"]) > 0
    for variant in results:
        r = _ok(results, variant)
        assert r["outs"] == stock["outs"], f"{variant}: one at a time differs from stock"
        assert r["batch"] == stock["batch"], f"{variant}: batched differs from stock"


def test_stock_is_stock_and_the_plugin_runs_where_installed(results: dict[str, dict[str, Any]]) -> None:
    assert not _ok(results, "stock")["plugin_loaded"]
    for variant in ("on", "off", "released"):
        if variant in results:
            r = _ok(results, variant)
            assert r["plugin_loaded"] and r["forecast"]["mode"] == variant, r.get("forecast")
            assert r["after"]["lost_mib"] is not None


def test_graph_memory_on_is_at_most_stocks_and_released_at_most_on(results: dict[str, dict[str, Any]]) -> None:
    mem = {v: _ok(results, v)["prefill_mem_gb"] for v in results}
    if "on" in mem:
        assert mem["on"] <= mem["stock"] + RESOLUTION_GB, mem
    if "released" in mem and "on" in mem:
        assert mem["released"] <= mem["on"] + RESOLUTION_GB, mem
    if "default" in mem:
        assert abs(mem["default"] - mem["stock"]) <= RESOLUTION_GB, mem  # installed, nothing changed
