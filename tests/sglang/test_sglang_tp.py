"""SGLang's real breakable engine under tensor parallelism, on CPU: two real processes, SGLang's own
TP ``GroupCoordinator`` over a real gloo process group (its ``barrier()`` between warmup and
capture, its ``all_reduce`` inside the captured segments). The CUDA graph primitive is the CPU
stand-in of ``cpu_graph_standin.py`` (a recorded collective replays as one more awaited call of
it). The same worker (``tests/gpu/sglang_tp_worker.py``) runs on two H200s with NCCL and PyNccl
(``tests/gpu/test_sglang_tp_gpu.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.slow, pytest.mark.usefixtures("backend_seam")]

GPU_TESTS = Path(__file__).resolve().parents[1] / "gpu"
SMALL = ["--device", "cpu", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
         "--intermediate", "128", "--layers", "2", "--dtype", "float32", "--max-tokens", "64", "--repeats", "2"]


def test_two_ranks_share_outputs_inside_sglangs_engine_with_its_tp_group() -> None:
    sys.path.insert(0, str(GPU_TESTS))
    from sglang_tp_worker import run_tp_variants

    results = run_tp_variants(["builtin", "on", "released"], SMALL, timeout=240)
    for variant, result in results.items():
        assert "error" not in result, (variant, result)
        assert result["meta"]["world_size"] == 2
    sizes, one = 10, 64 * 64 * 4  # SGLang's prefill schedule up to 64 tokens; one largest fp32 output
    barriers = set()
    for variant, result in results.items():
        ranks = result["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1], variant
        for r in ranks:
            assert r["group"] == "GroupCoordinator" and r["group_world_size"] == 2, r
            assert r["num_sizes"] == sizes and r["max_abs_err"] == 0.0, (variant, r)
            barriers.add(r["barriers"])
    assert len(barriers) == 1 and barriers.pop() >= sizes  # SGLang's own barrier, per size, every variant
    for r in results["on"]["ranks"]:
        assert r["fallbacks"] == 0 and r["resident_output_bytes"] == one
    for r in results["released"]["ranks"]:
        assert r["fallbacks"] == 0 and r["resident_output_bytes"] == 0
