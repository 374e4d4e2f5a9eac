"""SGLang's real breakable engine on two GPUs with its own 2-rank TP group (``nvidia-h200-x2``).

``sglang_tp_worker.run_tp_variants`` runs each variant as its own 2-rank job (NCCL, PyNccl for the
all-reduces inside the captured segments, as SGLang's TP group does by default, NVLink multicast
off) at the bench shapes (hidden 2880, 48 / 8 heads of 64 split over the ranks, intermediate
2880, 4 layers, bf16, SGLang's 74 prefill sizes up to 16384 tokens), and compares, per rank and
in the same run: our ``on`` and ``released`` against SGLang's built-in class and the floor.
Results go to ``$SGLANG_BCG_GPU_RESULTS_DIR/sglang_tp.jsonl`` as each variant ends. Skipped
unless two GPUs and SGLang (the bundle) are there; ``tests/sglang/test_sglang_tp.py`` runs the
same worker on CPU in CI.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.slow,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (run on nvidia-h200-x2)"
    ),
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs SGLang (source .sglbundle/install.sh)"),
]


def test_two_ranks_graph_memory_against_sglang_builtin() -> None:
    """Per rank: on <= built-in, on <= floor + one output, released within 2 % of the floor,
    replay == eager after the inputs change; both ranks hold the same output bytes."""
    from sglang_tp_worker import run_tp_variants

    names = os.environ.get("SGLANG_BCG_TP_VARIANTS", "builtin,floor,off,on,released").split(",")
    extra = os.environ.get("SGLANG_BCG_TP_ARGS", "").split()
    results = run_tp_variants(names, extra, timeout=420)
    failed = {v: r for v, r in results.items() if "error" in r}
    assert not failed, failed
    one = results["on"]["meta"]["one_output_bytes"]
    for rank in (0, 1):
        row = {v: r["ranks"][rank] for v, r in results.items()}
        graph = {v: r["graph_bytes"] for v, r in row.items()}
        assert all(r["rank"] == rank and r["group_world_size"] == 2 and r["pynccl"] for r in row.values()), row
        assert graph["on"] <= graph["builtin"] and graph["on"] <= graph["floor"] + one, (rank, graph)
        assert graph["released"] <= 1.02 * graph["floor"], (rank, graph)
        for v in set(row) - {"floor"}:
            assert row[v]["max_abs_err"] <= 1e-2, (rank, v, row[v]["max_abs_err"])
        assert row["on"]["resident_output_bytes"] == one and row["released"]["resident_output_bytes"] == 0
    for v, r in results.items():
        assert r["ranks"][0].get("resident_output_bytes") == r["ranks"][1].get("resident_output_bytes"), v
