"""SGLang 0.5.13's ``BreakableCudaGraphRunner`` with our hooks, on real CUDA graphs (H200).

The runner's real ``_capture_all`` / ``_capture_one`` (largest first, two warmups, SGLang's own
segment engine with an ``eager_on_graph`` break) on a side stream in a fresh graph pool; only
the model body is ours (``tests/sglang/seam_drivers.py``'s ``RunnerDriver``). Each mode is
checked against an eager forward after the inputs change, and graph memory (growth of
``torch.cuda.memory_reserved`` across the capture) against 0.5.13's built-in loop (one output
per size). Results go to ``$SGLANG_BCG_GPU_RESULTS_DIR/sglang_runner.json``. Skipped unless the
installed SGLang has the runner seam (``source .sglbundle-0.5.13/install.sh``).
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

SGLANG_TESTS = Path(__file__).resolve().parents[1] / "sglang"
MIB = 1 << 20
HIDDEN = 2880
SIZES = [4096, 2048, 1024, 512, 256, 64, 8]


def _seam_kind() -> str:
    from sglang_bcg_plugin.sglang.compat import seam_kind

    return seam_kind()


pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the H200 machine)"),
    pytest.mark.skipif(
        importlib.util.find_spec("sglang") is None or _seam_kind() != "runner",
        reason="needs SGLang 0.5.13, the runner seam (source .sglbundle-0.5.13/install.sh)",
    ),
    pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"),
]


@pytest.fixture(autouse=True)
def _sglang_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(SGLANG_TESTS))
    for var in ("SGLANG_ENABLE_BCG_SHARED_OUTPUT", "SGLANG_BCG_STALE_OUTPUT_GUARD", "SGLANG_BCG_SHARED_BUFFER"):
        monkeypatch.delenv(var, raising=False)
    import torchvision_standin

    if importlib.util.find_spec("torchvision") is None:
        torchvision_standin.install()


class Body:
    """``x @ w1`` | eager break ``silu`` | ``@ w2``: the layer stack's shape of work, bf16."""

    def __init__(self) -> None:
        import sglang.srt.model_executor.breakable_cuda_graph.breakable_cuda_graph as bcg

        g = torch.Generator(device="cuda").manual_seed(0)
        self.w1 = torch.randn(HIDDEN, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g) / HIDDEN**0.5
        self.w2 = torch.randn(HIDDEN, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g) / HIDDEN**0.5
        self.inputs = {n: torch.randn(n, HIDDEN, device="cuda", dtype=torch.bfloat16) for n in SIZES}
        self.act = bcg.eager_on_graph(True)(torch.nn.functional.silu)

    def forward_for(self, n: int) -> Any:
        return lambda: self.act(self.inputs[n] @ self.w1) @ self.w2

    def expected(self, n: int) -> torch.Tensor:
        return torch.nn.functional.silu(self.inputs[n] @ self.w1) @ self.w2

    def refill(self) -> None:
        for x in self.inputs.values():
            x.copy_(torch.randn_like(x))


def _capture(monkeypatch: pytest.MonkeyPatch, mode: str | None) -> dict[str, Any]:
    from seam_drivers import RunnerDriver

    if mode is not None:
        monkeypatch.setenv("SGLANG_ENABLE_BCG_SHARED_OUTPUT", mode)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    driver, body = RunnerDriver(monkeypatch, cuda=True, hooked=mode is not None), Body()
    inputs = torch.cuda.memory_reserved()
    driver.capture({driver.key(n): body.forward_for(n) for n in SIZES})
    torch.cuda.synchronize()
    graph_bytes = torch.cuda.memory_reserved() - inputs
    body.refill()
    worst = 0.0
    for n in SIZES:
        out = driver.replay(driver.key(n))
        torch.cuda.synchronize()
        worst = max(worst, (out.float() - body.expected(n).float()).abs().max().item())
    result = {"mode": mode or "built-in", "graph_mib": graph_bytes / MIB, "max_abs_error": worst,
              "before_mib": before / MIB}
    driver.cleanup()
    return result


def test_modes_against_the_builtin_runner(monkeypatch: pytest.MonkeyPatch) -> None:
    results = [_capture(monkeypatch, mode) for mode in (None, "off", "on", "released")]
    by = {r["mode"]: r for r in results}
    out = os.environ.get("SGLANG_BCG_GPU_RESULTS_DIR")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "sglang_runner.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2), file=sys.stderr)
    # bf16 matmuls: the graph replays the same kernels as the eager reference.
    assert all(r["max_abs_error"] == 0 for r in results), results
    assert by["on"]["graph_mib"] <= by["built-in"]["graph_mib"], results  # the saving #27659 meant
    assert by["released"]["graph_mib"] <= by["on"]["graph_mib"], results


def test_bench_shapes_vs_the_builtin_runner() -> None:
    """The bench shapes (74 sizes up to 16384 tokens, hidden 2880, 4 layers, bf16), each variant
    in a fresh process (``sglang_gpu_driver.py`` on the runner seam): ours on and released below
    0.5.13's one-output-per-size built-in, released at the floor (every output released inside
    its graph) within one allocator block, replay exact after the inputs change."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from sglang_gpu_driver import run_variants

    names = os.environ.get("SGLANG_BCG_GPU_MEMORY_VARIANTS", "builtin,floor,on,released,off").split(",")
    results = run_variants(names, [])
    out = os.environ.get("SGLANG_BCG_GPU_RESULTS_DIR")
    if out:
        Path(out, "sglang_engine.json").write_text(json.dumps(results, indent=1))
    errors = {v: r for v, r in results.items() if "meta" not in r or "error" in r["result"]}
    assert not errors, errors
    row = {v: r["result"] for v, r in results.items()}
    one = results["on"]["meta"]["one_output_bytes"]
    graph = {v: r["graph_bytes"] for v, r in row.items()}
    print(json.dumps({"graph_mib": {v: b / MIB for v, b in graph.items()},
                      "replay_ms": {v: r["replay_ms"] for v, r in row.items()}}), file=sys.stderr)
    assert graph["on"] <= graph["builtin"] and graph["on"] <= graph["floor"] + one + 2 * MIB, graph
    assert graph["released"] <= graph["floor"] + 2 * MIB, graph
    assert row["on"]["resident_output_bytes"] == one and row["released"]["resident_output_bytes"] == 0, row
    for v in set(row) - {"floor"}:
        assert row[v]["max_abs_err"] == 0, (v, row[v])
