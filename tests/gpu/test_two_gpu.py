"""Two GPUs: a 2-rank tensor-parallel capture with output sharing (``nvidia-h200-x2``).

Launches ``torchrun --nproc-per-node 2 tests/gpu/tp_worker.py`` (as ``python -m
torch.distributed.run``, the same program, so the interpreter under test is the one used) with
NVLink multicast off, and checks the worker's JSON: every rank replayed its TP forward (with an
all-reduce inside the graph) exactly like eager, with no fallbacks, and both ranks report the
same savings. Skipped unless two CUDA devices are visible.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.slow,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="needs two CUDA GPUs (run on nvidia-h200-x2)",
    ),
]

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().with_name("tp_worker.py")
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _worker_env(out_dir: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(NO_MULTICAST)
    env["SGLANG_BCG_GPU_RESULTS_DIR"] = out_dir
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.pop("SGLANG_BCG_TP_DEVICE", None)
    return env


def test_two_rank_tensor_parallel_capture_with_sharing(tmp_path: Path) -> None:
    out_dir = os.environ.get("SGLANG_BCG_GPU_RESULTS_DIR") or str(tmp_path)
    result_file = Path(out_dir) / "two_gpu_tp.json"
    result_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER)]
    proc = subprocess.run(cmd, env=_worker_env(out_dir), cwd=ROOT, capture_output=True, text=True, timeout=540, check=False)
    log = f"stdout:\n{proc.stdout[-6000:]}\nstderr:\n{proc.stderr[-6000:]}"
    assert proc.returncode == 0, log
    result = json.loads(result_file.read_text())
    assert result["passed"] and not result["failures"], result["failures"]
    assert result["world_size"] == 2
    sizes = result["sizes"]
    hidden = result["model"]["hidden"]
    expected_saved = (sum(sizes) - max(sizes)) * hidden * 4
    assert set(result["backends"]) == {"breakable", "full"}
    for name, ranks in result["backends"].items():
        assert [r["rank"] for r in ranks] == [0, 1], name
        assert {r["engine"] for r in ranks} == {"cuda"}, name
        assert [r["saved_bytes"] for r in ranks] == [expected_saved, expected_saved], name
        assert all(r["fallbacks"] == 0 and r["max_abs_err"] <= 1e-4 for r in ranks), (name, ranks)
        torch.testing.assert_close(ranks[0]["checksums"], ranks[1]["checksums"], rtol=1e-4, atol=1e-4)
