"""Incremental capture in a real SGLang server (docs/sglang.md#incremental-capture): ``launch_server`` with
``SGLANG_BCG_INCREMENTAL_CAPTURE=1`` answers while its prefill sizes are captured between batches (the
prompts of ``server_check.py`` one at a time, right after ``/health``), then, once its log says every size is
captured, gives the greedy ids of a server that captured everything first (one at a time and batched); its
log shows the largest size first and every size captured. Tiny Llama by default
(``SGLANG_BCG_SERVER_SHAPE``). Needs a server bundle set up (``scripts/server/gpu-server-check.sh`` with
``SGLANG_BCG_SERVER_TESTS=tests/gpu/test_incremental_server_gpu.py``). Results:
``$SGLANG_BCG_GPU_RESULTS_DIR/incremental_<shape>.json``."""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest
from server_scripts import NEEDS_SERVER, load

SHAPE = os.environ.get("SGLANG_BCG_SERVER_SHAPE", "tiny")
CHUNK = {"tiny": 4096, "llama3-8b": 16384}

pytestmark = NEEDS_SERVER
ALL = re.compile(r"incremental capture: all \d+ prefill sizes captured")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    check, make = load("server_check"), load("make_model")
    out = Path(os.environ.get("SGLANG_BCG_GPU_RESULTS_DIR", tmp_path_factory.mktemp("inc")))
    out.mkdir(parents=True, exist_ok=True)
    model = make.make_model(tmp_path_factory.mktemp("model") / SHAPE, **make.SHAPES[SHAPE])
    server_env, wait_healthy = check.server_env, check.wait_healthy
    found: dict[str, dict[str, Any]] = {}
    for name, extra in (("all-first", {}), ("incremental", {"SGLANG_BCG_INCREMENTAL_CAPTURE": "1"})):
        log = out / f"server-incremental-{SHAPE}-{name}.log"
        window: dict[str, Any] = {}
        check.server_env = lambda variant, path, extra=extra: {**server_env(variant, path), **extra}
        if extra:  # once healthy: answers while sizes are still captured, then wait for every size
            check.wait_healthy = lambda base, proc, timeout, log=log, window=window: _window(
                check, wait_healthy, base, proc, timeout, log, window)
        args = argparse.Namespace(
            model=str(model), variant="on", plugin_path=os.environ["PLUGIN_SITE"], chunked_prefill_size=CHUNK[SHAPE],
            mem_fraction_static=0.3 if SHAPE == "tiny" else 0.5, max_total_tokens=131072, server_arg=[],
            throughput=False, completions=False, start_timeout=600.0, timeout=300.0,
            log=str(log))
        try:
            found[name] = check.run_variant(args)
        finally:
            check.server_env, check.wait_healthy = server_env, wait_healthy
        found[name]["window"] = window
        found[name]["log_lines"] = [line for line in Path(args.log).read_text(errors="replace").splitlines()
                                    if "incremental capture" in line][-6:]
        print(f"incremental {SHAPE} {name}: " + json.dumps({k: v for k, v in found[name].items()
                                                          if k not in ("outs", "batch", "log_tail")}), flush=True)
    (out / f"incremental_{SHAPE}.json").write_text(json.dumps(found, indent=1) + "\n")
    return found


def _window(check: Any, wait_healthy: Any, base: str, proc: Any, timeout: float, log: Path,
            window: dict[str, Any]) -> float:
    """Healthy; then the prompts one at a time while the sizes are captured (their ids, and how many
    sizes were still pending when they ended), then until the log says every size is captured."""
    up = wait_healthy(base, proc, timeout)
    start = time.time()
    window["outs"] = [check.generate(base, x, check.NEW_TOKENS, 300.0)["output_ids"] for x in check.prompts()]
    window["answered_s"] = round(time.time() - start, 2)
    window["all_captured_during"] = ALL.search(log.read_text(errors="replace")) is not None
    while ALL.search(log.read_text(errors="replace")) is None and time.time() - start < 300:
        time.sleep(0.5)
    window["all_captured_s"] = round(time.time() - start, 2)
    return up


def test_answers_while_capturing_then_equal_a_server_that_captured_everything_first(results: dict[str, dict[str, Any]]) -> None:
    first, inc = results["all-first"], results["incremental"]
    assert first["ok"] and inc["ok"], inc.get("log_tail") or first.get("log_tail")
    # while sizes were captured every prompt was answered (an eager batch may pick another near-tie token)
    assert len(inc["window"]["outs"]) == len(first["outs"]) and all(inc["window"]["outs"])
    assert inc["outs"] == first["outs"] and inc["batch"] == first["batch"]  # every size captured


def test_the_log_shows_the_largest_first_then_every_size(results: dict[str, dict[str, Any]]) -> None:
    lines = "\n".join(results["incremental"]["log_lines"])
    assert re.search(r"incremental capture: the largest prefill size \(\d+ tokens\) captured in [\d.]+ s[^;]*; \d+ more", lines), lines
    assert ALL.search(lines), lines
    assert not results["all-first"]["log_lines"]
