"""Two-rank tensor-parallel capture with output sharing (launched by ``test_two_gpu.py``).

``torchrun --nproc-per-node 2 tests/gpu/tp_worker.py``. Each rank holds a column/row-parallel
shard of the bench decoder (attention heads and MLP columns split across ranks; ``o_proj`` and
``down`` row-parallel followed by ``dist.all_reduce`` *inside the captured forward*). For the
Breakable and Full backends with ``output_mode="on"`` it captures several sizes largest first,
with ``post_warmup_hook=dist.barrier`` between warmup and capture, changes the inputs, and checks
on each rank: replay == eager, both ranks hold the same output, no fallbacks, and the ranks
report the same ``memory_report().saved_bytes`` (the analytic value). Rank 0 writes
``$SGLANG_BCG_GPU_RESULTS_DIR/two_gpu_tp.json``; any failure on any rank exits 1 on every rank.

``SGLANG_BCG_TP_DEVICE=cpu`` runs the same script on CPU (gloo, eager engine): a smoke test of the
script itself on machines without GPUs.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from sglang_bcg_plugin import BackendOptions, ShapeKey, create_backend
from sglang_bcg_plugin.bench.model import attention_break, attention_op

HIDDEN, HEADS, KV_HEADS, INTERMEDIATE, LAYERS = 1024, 16, 8, 2048, 2
SIZES = [1024, 512, 256, 128, 64, 32, 16, 8]  # largest first
TOL = 1e-4


def _norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class TPDecoder:
    """Column-parallel qkv / gate / up, row-parallel o / down, one all-reduce after each."""

    def __init__(self, rank: int, world: int, device: str, attention: Any) -> None:
        assert HEADS % world == 0 and KV_HEADS % world == 0 and INTERMEDIATE % world == 0
        self.attention = attention
        self.head_dim = HIDDEN // HEADS
        self.heads, self.kv_heads = HEADS // world, KV_HEADS // world
        q_cols, kv_cols, inter = self.heads * self.head_dim, self.kv_heads * self.head_dim, INTERMEDIATE // world
        self.q_cols, self.kv_cols = q_cols, kv_cols
        g = torch.Generator().manual_seed(0)  # same full weights on every rank; each keeps its shard

        def full(rows: int, cols: int) -> torch.Tensor:
            return torch.randn(rows, cols, generator=g) / cols**0.5

        def rows_of(t: torch.Tensor, n: int) -> torch.Tensor:
            return t[rank * n : (rank + 1) * n].contiguous().to(device)

        def cols_of(t: torch.Tensor, n: int) -> torch.Tensor:
            return t[:, rank * n : (rank + 1) * n].contiguous().to(device)

        self.layers = []
        for _ in range(LAYERS):
            wq, wk, wv = full(HIDDEN, HIDDEN), full(KV_HEADS * self.head_dim, HIDDEN), full(KV_HEADS * self.head_dim, HIDDEN)
            wo, wg, wu, wd = full(HIDDEN, HIDDEN), full(INTERMEDIATE, HIDDEN), full(INTERMEDIATE, HIDDEN), full(HIDDEN, INTERMEDIATE)
            self.layers.append(
                {
                    "qkv": torch.cat([rows_of(wq, q_cols), rows_of(wk, kv_cols), rows_of(wv, kv_cols)]),
                    "o": cols_of(wo, q_cols),
                    "gate_up": torch.cat([rows_of(wg, inter), rows_of(wu, inter)]),
                    "down": cols_of(wd, inter),
                }
            )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for w in self.layers:
            qkv = F.linear(_norm(h), w["qkv"])
            q, k, v = qkv.split([self.q_cols, self.kv_cols, self.kv_cols], dim=-1)
            out = torch.empty(h.shape[0], self.q_cols, dtype=h.dtype, device=h.device)
            self.attention(q.contiguous(), k.contiguous(), v.contiguous(), out, self.heads, self.kv_heads)
            o = F.linear(out, w["o"])
            dist.all_reduce(o)  # row-parallel o_proj: inside the captured graph
            h = h + o
            gate, up = F.linear(_norm(h), w["gate_up"]).chunk(2, dim=-1)
            d = F.linear(F.silu(gate) * up, w["down"])
            dist.all_reduce(d)  # row-parallel down_proj
            h = h + d
        return _norm(h)


def run_backend(name: str, rank: int, world: int, device: str, engine: str, failures: list[str]) -> dict[str, Any]:
    model = TPDecoder(rank, world, device, attention_break if name == "breakable" else attention_op)
    g = torch.Generator().manual_seed(1)  # replicated activations: the same input on every rank
    x_max = torch.randn(SIZES[0], HIDDEN, generator=g).to(device)
    backend = create_backend(name, options=BackendOptions(output_mode="on", engine=engine))
    barriers = {"n": 0}

    def barrier() -> None:
        barriers["n"] += 1
        dist.barrier()

    keys = [ShapeKey(s) for s in SIZES]
    start = time.perf_counter()
    with torch.no_grad(), backend.capture_session():
        for key in keys:
            x = x_max[: key.size]
            backend.capture_one(key, lambda x=x: model(x), capture_inputs=x_max, post_warmup_hook=barrier)
    capture_s = time.perf_counter() - start
    report = backend.memory_report()

    with torch.no_grad():
        x_max.copy_(torch.randn(SIZES[0], HIDDEN, generator=g).to(device))  # inputs change
        max_err = 0.0
        checksums = []
        for key in keys:
            out = backend.replay(key).clone()
            ref = model(x_max[: key.size])
            max_err = max(max_err, float((out - ref).abs().max()))
            checksums.append(float(out.double().sum()))
    expected_saved = (sum(SIZES) - SIZES[0]) * HIDDEN * 4
    if max_err > TOL:
        failures.append(f"rank {rank} {name}: replay != eager (max error {max_err:.3g})")
    if report.fallbacks:
        failures.append(f"rank {rank} {name}: fallbacks {dict(report.fallbacks)}")
    if not all(k.shared for k in report.keys):
        failures.append(f"rank {rank} {name}: not every key shares")
    if report.saved_bytes != expected_saved:
        failures.append(f"rank {rank} {name}: saved {report.saved_bytes} != expected {expected_saved}")
    if barriers["n"] != len(keys) * backend.options.num_warmups:
        failures.append(f"rank {rank} {name}: {barriers['n']} barriers for {len(keys)} keys")
    segments = sorted({backend.num_segments(k) for k in keys})
    if engine == "cuda" and segments != [LAYERS + 1 if name == "breakable" else 1]:
        failures.append(f"rank {rank} {name}: segments {segments}")
    backend.cleanup()
    return {
        "rank": rank,
        "saved_bytes": report.saved_bytes,
        "resident_output_bytes": report.resident_output_bytes,
        "logical_output_bytes": report.logical_output_bytes,
        "fallbacks": len(report.fallbacks),
        "max_abs_err": max_err,
        "checksums": checksums,
        "num_segments": segments,
        "capture_s": capture_s,
        "engine": report.engine,
    }


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    on_cpu = os.environ.get("SGLANG_BCG_TP_DEVICE") == "cpu"
    if on_cpu:
        device, engine = "cpu", "eager"
        dist.init_process_group("gloo")
    else:
        torch.cuda.set_device(local)
        device, engine = f"cuda:{local}", "cuda"
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    failures: list[str] = []
    results: dict[str, list[dict[str, Any]]] = {}
    for name in ("breakable", "full"):
        try:
            mine = run_backend(name, rank, world, device, engine, failures)
        except Exception as exc:  # noqa: BLE001 - reported by every rank, below
            # the other rank may be waiting in a collective: report and leave (torchrun then
            # stops the group and exits non-zero)
            failures.append(f"rank {rank} {name}: {type(exc).__name__}: {exc}")
            print("\n".join(failures), file=sys.stderr, flush=True)
            os._exit(1)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, mine)
        results[name] = gathered
        saved = {r["saved_bytes"] for r in gathered}
        if len(saved) != 1:
            failures.append(f"{name}: ranks report different savings {[r['saved_bytes'] for r in gathered]}")
        sums = [r["checksums"] for r in gathered]
        for other in sums[1:]:
            if any(abs(a - b) > TOL * max(1.0, abs(a)) for a, b in zip(sums[0], other, strict=True)):
                failures.append(f"{name}: ranks hold different outputs {sums}")
    all_failures: list[Any] = [None] * world
    dist.all_gather_object(all_failures, failures)
    merged = [f for fs in all_failures for f in fs]
    if rank == 0:
        payload = {
            "world_size": world,
            "device": torch.cuda.get_device_name(local) if not on_cpu else "cpu",
            "sizes": SIZES,
            "model": {"hidden": HIDDEN, "heads": HEADS, "kv_heads": KV_HEADS, "intermediate": INTERMEDIATE, "layers": LAYERS},
            "backends": results,
            "failures": merged,
            "passed": not merged,
        }
        out_dir = os.environ.get("SGLANG_BCG_GPU_RESULTS_DIR")
        if out_dir:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            (Path(out_dir) / "two_gpu_tp.json").write_text(json.dumps(payload, indent=2))
        print(json.dumps({k: payload[k] for k in ("world_size", "failures", "passed")}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if merged else 0


if __name__ == "__main__":
    sys.exit(main())
