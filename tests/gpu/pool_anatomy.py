"""What a graph pool holds at the largest size, against the forward's own peak (issue 21).

``python3 tests/gpu/pool_anatomy.py [--tokens 16384] [--out DIR]`` builds transformers'
``LlamaModel`` at the bench's CUDA shapes and measures, at one size:

* the forward's own peak (``max_memory_allocated`` delta of a warm forward, no graphs): eager,
  Inductor-compiled (``torch.compile(dynamic=True)``, as the bench's Inductor Full and Graph
  Trees compile it), and our Piecewise's Inductor pieces run eagerly;
* one capture of that size into a fresh pool, outputs released, for Inductor Piecewise,
  Inductor Full and CUDA Graph Trees: the pool's segments, the peak of the bytes live in it
  during the capture, and the largest blocks live at that peak with the code that asked for them.

A pool can be no smaller than the peak of what is live in it; the forward's compiled peak is
that floor for every graph backend that runs the same compiled code. Prints a table and writes
``pool_anatomy.json`` under ``--out``. A measurement to explain a gap, not a test.
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path
from typing import Any

import torch

from replay_profile import inductor_backend  # tests/gpu, beside this file
from sglang_bcg_plugin import ShapeKey
from sglang_bcg_plugin.bench.workload import LlamaWorkload, ModelShape

MIB = 1 << 20
KEEP = ("torchinductor", "transformers", "sglang_bcg_plugin", "functional.py")


def forward_peak(fn: Any, workload: LlamaWorkload, static: torch.Tensor, tokens: int) -> dict[str, float]:
    with torch.no_grad():
        for _ in range(2):
            out = workload.call(fn, static, tokens)
            del out
        torch.cuda.synchronize()
        gc.collect()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = workload.call(fn, static, tokens)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        held = torch.cuda.memory_allocated() - base
        del out
    return {"peak_mib": peak / MIB, "output_mib": held / MIB}


def _frames(event: dict[str, Any]) -> str:
    keep = [f"{Path(f['filename']).name}:{f['line']}:{f['name']}" for f in event.get("frames", [])
            if any(k in f["filename"] for k in KEEP)]
    return " < ".join(keep[:3]) or "?"


def _pools() -> set[tuple[int, int]]:
    return {tuple(s.get("segment_pool_id", (0, 0))) for s in torch.cuda.memory._snapshot()["segments"]}  # type: ignore[misc]


def pool_anatomy(run: Any, pools: set[tuple[int, int]] | None = None) -> dict[str, Any]:
    """Run ``run()`` (one capture) with the allocator's history on; the segments of the pools
    made since ``pools`` (default: now), the peak of the bytes live inside them during ``run``,
    and the largest blocks live at that peak."""
    pools = _pools() if pools is None else pools
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=1_000_000)
    try:
        free_before = torch.cuda.mem_get_info()[0]
        keep = run()
        torch.cuda.synchronize()
        free_after = torch.cuda.mem_get_info()[0]
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    segs = [(int(s["address"]), int(s["total_size"])) for s in snap["segments"]
            if tuple(s.get("segment_pool_id", (0, 0))) not in pools and tuple(s.get("segment_pool_id", (0, 0))) != (0, 0)]
    inside = lambda a: any(lo <= a < lo + n for lo, n in segs)  # noqa: E731
    live: dict[int, dict[str, Any]] = {}
    cur = peak = 0
    at_peak: list[dict[str, Any]] = []
    for e in snap["device_traces"][torch.cuda.current_device()]:
        if not inside(int(e["addr"])):
            continue
        if e["action"] == "alloc":
            live[e["addr"]] = e
            cur += e["size"]
            if cur > peak:
                peak, at_peak = cur, list(live.values())
        elif e["action"] == "free_requested" and e["addr"] in live:
            cur -= live.pop(e["addr"])["size"]
    at_peak.sort(key=lambda e: -e["size"])
    del keep
    return {"segments_mib": sum(n for _, n in segs) / MIB, "num_segments": len(segs),
            "segment_sizes_mib": sorted((n / MIB for _, n in segs), reverse=True)[:12],
            "peak_live_mib": peak / MIB, "device_mib": (free_before - free_after) / MIB,
            "largest_at_peak": [(e["size"] / MIB, _frames(e)) for e in at_peak[:14]]}


def ours(name: str, workload: LlamaWorkload, tokens: int) -> tuple[dict[str, float], dict[str, Any]]:
    backend, fn, static = inductor_backend(name, workload, tokens, mode="released")
    eager = forward_peak(fn, workload, static, tokens)

    def run() -> Any:
        with torch.no_grad(), backend.capture_session():
            return backend.capture_one(ShapeKey(tokens), lambda: workload.call(fn, static, tokens), capture_inputs=static)

    anatomy = pool_anatomy(run)
    backend.cleanup()
    return eager, anatomy


def graph_trees(workload: LlamaWorkload, tokens: int) -> dict[str, Any]:
    torch._dynamo.reset()
    model, static = workload.model_for("full", tokens), workload.static_input(tokens)
    compiled = torch.compile(model, mode="reduce-overhead", dynamic=True)

    def step() -> Any:
        torch.compiler.cudagraph_mark_step_begin()
        return workload.call(compiled, static, tokens)

    pools = _pools()
    with torch.no_grad():
        step()  # compiles and warms up (Graph Trees record on the next step)
        anatomy = pool_anatomy(lambda: [step() for _ in range(2)][-1], pools)
    del compiled
    torch._dynamo.reset()
    torch._inductor.cudagraph_trees.reset_cudagraph_trees()
    return anatomy


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--out", default=".")
    ap.add_argument("--skip-graph-trees", action="store_true")
    args = ap.parse_args()
    workload = LlamaWorkload(ModelShape(2880, 4, 64, 8, 64, 2880, torch.bfloat16, "cuda"))
    static = workload.static_input(args.tokens)
    result: dict[str, Any] = {"tokens": args.tokens}
    result["eager_forward"] = forward_peak(workload.model_for("full", args.tokens), workload, static, args.tokens)
    print(f"eager forward: {result['eager_forward']}", flush=True)
    for name in ("piecewise", "full"):
        eager, anatomy = ours(name, workload, args.tokens)
        result[name] = {"forward": eager, "pool": anatomy}
        print(f"{name} (Inductor): forward {eager}; pool {anatomy['segments_mib']:.0f} MiB in "
              f"{anatomy['num_segments']} segments {anatomy['segment_sizes_mib']}, peak live "
              f"{anatomy['peak_live_mib']:.0f} MiB, device {anatomy['device_mib']:.0f} MiB", flush=True)
        for mib, where in anatomy["largest_at_peak"]:
            print(f"   {mib:8.1f} MiB  {where[:150]}")
    if not args.skip_graph_trees:
        anatomy = graph_trees(workload, args.tokens)
        result["graph_trees"] = {"pool": anatomy}
        print(f"graph trees: pool {anatomy['segments_mib']:.0f} MiB in {anatomy['num_segments']} segments "
              f"{anatomy['segment_sizes_mib']}, peak live {anatomy['peak_live_mib']:.0f} MiB, device "
              f"{anatomy['device_mib']:.0f} MiB", flush=True)
        for mib, where in anatomy["largest_at_peak"]:
            print(f"   {mib:8.1f} MiB  {where[:150]}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "pool_anatomy.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
