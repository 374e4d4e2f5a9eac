"""SGLang's real breakable engine under tensor parallelism, on CPU: two real processes, SGLang's own
TP ``GroupCoordinator`` over a real gloo process group (its ``barrier()`` between warmup and
capture, its ``all_reduce`` inside the captured segments). The CUDA graph primitive is the CPU
stand-in of ``cpu_graph_standin.py`` (a recorded collective replays as one more awaited call of
it). The same worker (``tests/gpu/sglang_tp_worker.py``) runs on two H200s with NCCL and PyNccl
(``tests/gpu/test_sglang_tp_gpu.py``), there one ``torchrun`` job per variant; here the worker's
``main`` runs in two ranks forked (as ``torchrun`` would start them: ``RANK``, one thread each) from
a child that made the worker's imports once (``conftest.run_child``), one variant at a time."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import run_child

pytestmark = [pytest.mark.sglang, pytest.mark.slow, pytest.mark.usefixtures("backend_seam")]

GPU_TESTS = Path(__file__).resolve().parents[1] / "gpu"
SMALL = ["--device", "cpu", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
         "--intermediate", "128", "--layers", "2", "--dtype", "float32", "--max-tokens", "64", "--repeats", "2"]


#: Run in a child with GPU, OUT and SMALL set: each variant's two ranks forked, one variant at a
#: time.
RANKS = """
import multiprocessing as mp, os, sys, time
sys.path.insert(0, GPU)
import torch
import sglang_tp_worker
from sglang_bcg_setup import import_sglang
from fork_server import free_port
import_sglang()  # each rank's first step, made once before the ranks fork

def run_rank(variant, rank, port):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    sys.stdout = sys.stderr = open(os.path.join(OUT, f"{variant}-{rank}.log"), "w")
    sys.exit(sglang_tp_worker.main([variant, *SMALL]))

results = {}
for variant in ("builtin", "on", "released"):
    port = free_port()
    fork = mp.get_context("fork")
    ranks = [fork.Process(target=run_rank, args=(variant, r, port)) for r in (0, 1)]
    for p in ranks:
        p.start()
    deadline = time.monotonic() + 240
    while any(p.exitcode is None for p in ranks) and time.monotonic() < deadline:
        if any(p.exitcode for p in ranks):
            break  # one failed: the other may wait in a collective
        time.sleep(0.1)
    for p in ranks:
        if p.exitcode is None:
            p.kill()
        p.join()
    logs = [open(os.path.join(OUT, f"{variant}-{r}.log")).read() for r in (0, 1)]
    lines = [ln for ln in logs[0].splitlines() if ln.startswith("RESULT=")]
    if [p.exitcode for p in ranks] != [0, 0] or not lines:
        results[variant] = {"error": [p.exitcode for p in ranks], "logs": [g[-3000:] for g in logs]}
    else:
        results[variant] = json.loads(lines[-1][len("RESULT="):])
report(results=results)
"""


def test_two_ranks_share_outputs_inside_sglangs_engine_with_its_tp_group(
    dist_dir: Path, tmp_path: Path
) -> None:
    where = f"GPU, OUT, SMALL = {str(GPU_TESTS)!r}, {str(tmp_path)!r}, {SMALL!r}\n"
    results = run_child(where + RANKS, dist_dir, timeout=900).result["results"]
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
