"""Incremental capture in a real SGLang server (docs/sglang.md#incremental-capture): ``launch_server`` with
``SGLANG_BCG_INCREMENTAL_CAPTURE=1`` answers while its prefill sizes are captured between batches, with the
greedy ids of a server that captured everything first (``server_check.py``'s prompts, one at a time and
batched), and its log shows the largest size first and every size captured. Tiny Llama by default
(``SGLANG_BCG_SERVER_SHAPE``). Needs a server bundle set up (``scripts/server/gpu-server-check.sh`` with
``SGLANG_BCG_SERVER_TESTS=tests/gpu/test_incremental_server_gpu.py``). Results:
``$SGLANG_BCG_GPU_RESULTS_DIR/incremental_<shape>.json``."""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
from server_scripts import NEEDS_SERVER, load

SHAPE = os.environ.get("SGLANG_BCG_SERVER_SHAPE", "tiny")
CHUNK = {"tiny": 4096, "llama3-8b": 16384}

pytestmark = NEEDS_SERVER


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    check, make = load("server_check"), load("make_model")
    out = Path(os.environ.get("SGLANG_BCG_GPU_RESULTS_DIR", tmp_path_factory.mktemp("inc")))
    out.mkdir(parents=True, exist_ok=True)
    model = make.make_model(tmp_path_factory.mktemp("model") / SHAPE, **make.SHAPES[SHAPE])
    server_env = check.server_env
    found = {}
    for name, extra in (("all-first", {}), ("incremental", {"SGLANG_BCG_INCREMENTAL_CAPTURE": "1"})):
        check.server_env = lambda variant, path, extra=extra: {**server_env(variant, path), **extra}
        args = argparse.Namespace(
            model=str(model), variant="on", plugin_path=os.environ["PLUGIN_SITE"], chunked_prefill_size=CHUNK[SHAPE],
            mem_fraction_static=0.3 if SHAPE == "tiny" else 0.5, max_total_tokens=131072, server_arg=[],
            throughput=False, completions=False, start_timeout=600.0, timeout=300.0,
            log=str(out / f"server-incremental-{SHAPE}-{name}.log"))
        try:
            found[name] = check.run_variant(args)
        finally:
            check.server_env = server_env
        found[name]["log_lines"] = [line for line in Path(args.log).read_text(errors="replace").splitlines()
                                    if "incremental capture" in line][:5]
        print(f"incremental {SHAPE} {name}: " + json.dumps({k: v for k, v in found[name].items()
                                                          if k not in ("outs", "batch", "log_tail")}), flush=True)
    (out / f"incremental_{SHAPE}.json").write_text(json.dumps(found, indent=1) + "\n")
    return found


def test_answers_equal_a_server_that_captured_everything_first(results: dict[str, dict[str, Any]]) -> None:
    first, inc = results["all-first"], results["incremental"]
    assert first["ok"] and inc["ok"], inc.get("log_tail") or first.get("log_tail")
    assert inc["outs"] == first["outs"] and inc["batch"] == first["batch"]


def test_the_log_shows_the_largest_first_then_every_size(results: dict[str, dict[str, Any]]) -> None:
    lines = "\n".join(results["incremental"]["log_lines"])
    assert re.search(r"incremental capture: the largest prefill size \(\d+ tokens\) captured; \d+ more", lines), lines
    assert re.search(r"incremental capture: all \d+ prefill sizes captured", lines), lines
    assert not results["all-first"]["log_lines"]
