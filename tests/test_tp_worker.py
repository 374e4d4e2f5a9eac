"""The tensor-parallel worker of ``tests/gpu/test_two_gpu.py``, on CPU: two real processes, a
real gloo process group, the bench's measurement on each rank (the eager engine stands in for CUDA
graphs, gloo for NCCL). The same script runs on two H200s (``nvidia-h200-x2``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "gpu" / "tp_worker.py"
sys.path.insert(0, str(WORKER.parent))

import tp_worker  # noqa: E402


def _launch(out: Path, *flags: str, nproc: int = 2) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, SGLANG_BCG_TP_DEVICE="cpu", SGLANG_BCG_GPU_RESULTS_DIR=str(out), OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), str(WORKER), *flags]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.slow
def test_two_ranks_capture_every_backend_and_mode_on_gloo(tmp_path: Path) -> None:
    proc = _launch(tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads((tmp_path / "two_gpu_tp.json").read_text())
    assert result["passed"] and result["failures"] == []
    assert result["world_size"] == 2 and result["device"] == "cpu"
    rows = {(r["backend"], r["variant"], r["rank"]) for r in result["rows"]}
    assert rows == {(b, v, k) for b in tp_worker.BACKENDS for v in tp_worker.TP_VARIANTS for k in (0, 1)}
    one = result["model"]["hidden"] * 4  # fp32 rows
    for r in result["rows"]:
        assert r["max_abs_err"] == 0.0 and r["fallbacks"] == 0
        assert r["logical_output_bytes"] == sum(result["sizes"]) * one
        if r["variant"] == "on":
            assert r["resident_output_bytes"] == max(result["sizes"]) * one
    # both ranks and all three backends' models computed the same replicated output
    sums = {s for per_rank in result["checksums"] for s in per_rank.values()}
    assert len(result["checksums"]) == 2 and max(sums) - min(sums) <= 1e-4 * max(1.0, abs(max(sums)))
    # and that output is the unsplit model's (one process holding every weight)
    assert all(e < 1e-5 for e in result["unsplit_mean_abs_err"]), result["unsplit_mean_abs_err"]


def test_a_rank_whose_replay_is_wrong_fails_every_rank(tmp_path: Path) -> None:
    """The worker's own checks can fail: with a tolerance below zero every row is wrong."""
    proc = _launch(tmp_path, "--backends", "full", "--variants", "on", "--max-tokens", "8", "--tolerance", "-1")
    assert proc.returncode != 0
    result = json.loads((tmp_path / "two_gpu_tp.json").read_text())
    assert not result["passed"]
    assert {f.split(":")[0] for f in result["failures"]} == {"rank 0 full/on", "rank 1 full/on"}


def test_shapes_that_do_not_split_are_refused_before_any_work() -> None:
    shape = tp_worker.ModelShape(hidden=64, layers=1, heads=3, kv_heads=1, head_dim=16, intermediate=64, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="heads 3 does not split over 2 ranks"):
        tp_worker.tp_decoder(shape, rank=0, world=2, attention=tp_worker.attention_op)


def test_unknown_backends_or_variants_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        tp_worker.parse_args(["--backends", "full,graphs"], cuda=False)
    assert exc.value.code == 2
    assert "--backends: unknown graphs; choose from breakable, full, piecewise" in capsys.readouterr().err
