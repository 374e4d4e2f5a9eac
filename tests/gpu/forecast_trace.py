"""Record the CUDA caching allocator's events while our backends capture the bench schedule.

Data for the graph-memory forecast (issue 22): which blocks each capture allocates and frees, in
which pool, and what the capture cost in device memory, so an allocator model can be checked
against the real allocator's decisions offline. Not a test.

``python tests/gpu/forecast_trace.py OUTDIR [--model synthetic|llama|FAMILY] [--backends full,breakable]
[--modes off,on,released] [--max-tokens N]`` writes ``OUTDIR/trace-BACKEND-MODE.json.gz`` (per key:
the allocator events ``[action, addr, size, stream]`` of its warmups and capture, its reserved
growth; per capture: the ``mem_get_info`` graph bytes, the pool's segments at the end) and
``OUTDIR/trace-eager.json.gz`` (one eager forward at the largest, a middle and the smallest
size, each after a warm one, with the events of each).
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

ACTIONS = {"alloc": 0, "free_requested": 1, "free_completed": 2, "segment_alloc": 3, "segment_free": 4,
           "segment_map": 5, "segment_unmap": 6, "snapshot": 7, "oom": 8}


def _events(start: int) -> tuple[list[list[int]], int]:
    trace = torch.cuda.memory._snapshot()["device_traces"][0]
    new = [[ACTIONS.get(e["action"], 9), int(e["addr"]), int(e["size"]), int(e.get("stream", 0))] for e in trace[start:]]
    return new, len(trace)


def _segments() -> list[dict[str, Any]]:
    out = []
    for s in torch.cuda.memory._snapshot()["segments"]:
        out.append({"address": int(s["address"]), "total_size": int(s["total_size"]), "stream": int(s["stream"]),
                    "pool": list(s.get("segment_pool_id", (0, 0))), "segment_type": s.get("segment_type"),
                    "blocks": [[int(b["size"]), b["state"][0]] for b in s["blocks"]]})
    return out


def _free() -> tuple[int, int]:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return int(torch.cuda.mem_get_info()[0]), int(torch.cuda.memory_reserved())


def eager(workload: Any, sizes: list[int]) -> dict[str, Any]:
    model = workload.model_for("full", max(sizes))
    static = workload.static_input(max(sizes))
    out: dict[str, Any] = {}
    with torch.no_grad():
        for n in (sizes[0], sizes[len(sizes) // 2], sizes[-1]):
            workload.call(model, static, n)  # warm
            torch.cuda.synchronize()
            _, start = _events(0)
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            workload.call(model, static, n)
            torch.cuda.synchronize()
            events, _ = _events(start)
            out[str(n)] = {"events": events, "peak_bytes": torch.cuda.max_memory_allocated() - base}
    return out


def capture(workload: Any, backend_name: str, mode: str, sizes: list[int]) -> dict[str, Any]:
    from sglang_bcg_plugin import BackendOptions, ShapeKey, create_backend

    torch._dynamo.reset()
    backend = create_backend(backend_name, options=BackendOptions(output_mode=mode, engine="cuda"))
    model = workload.model_for(backend_name, max(sizes))
    static = workload.static_input(max(sizes))
    free0, reserved0 = _free()
    _, cursor = _events(0)
    keys = []
    t0 = time.perf_counter()
    with torch.no_grad(), backend.capture_session():
        for n in sizes:
            backend.capture_one(ShapeKey(n), lambda n=n: workload.call(model, static, n), capture_inputs=static)
            events, cursor = _events(cursor)
            keys.append({"size": n, "events": events})
    seconds = time.perf_counter() - t0
    segments = _segments()
    free1, reserved1 = _free()
    kept = _segments()  # what empty_cache could not give back (the pool's, and any other still in use)
    report = backend.memory_report()
    for k, r in zip(keys, report.keys, strict=True):
        k["graph_memory_bytes"] = r.graph_memory_bytes
        k["resident_output_bytes"] = r.resident_output_bytes
        k["logical_output_bytes"] = r.logical_output_bytes
    backend.cleanup()
    return {"backend": backend_name, "mode": mode, "graph_bytes": free0 - free1, "reserved_bytes": reserved1 - reserved0,
            "resident_output_bytes": report.resident_output_bytes, "seconds": seconds, "keys": keys, "segments": segments,
            "segments_kept": kept}


def main(argv: list[str]) -> int:
    from sglang_bcg_plugin.bench.runner import warm_up
    from sglang_bcg_plugin.bench.sizes import prefill_capture_sizes
    from sglang_bcg_plugin.bench.workload import LlamaWorkload, ModelShape, SyntheticWorkload

    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", default="synthetic")
    ap.add_argument("--backends", default="full,breakable")
    ap.add_argument("--modes", default="off,on,released")
    ap.add_argument("--max-tokens", type=int, default=16384)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workload: Any
    if args.model not in ("synthetic", "llama"):  # a family of forecast_families.py (it fixes its shape)
        from forecast_families import WORKLOADS

        workload = WORKLOADS[args.model](ModelShape(0, 0, 0, 0, 0, 0, torch.bfloat16, "cuda"))
    elif args.model == "llama":
        shape = ModelShape(2880, 4, 64, 8, 64, 2880, torch.bfloat16, "cuda")
        workload = LlamaWorkload(shape)
    else:
        shape = ModelShape(2880, 4, 45, 5, 64, 2880, torch.bfloat16, "cuda")
        workload = SyntheticWorkload(shape)
    sizes = sorted(prefill_capture_sizes(args.max_tokens), reverse=True)
    backends = args.backends.split(",")
    warm_up(workload, backends)
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=2_000_000)
    with gzip.open(out / f"trace-eager-{args.model}.json.gz", "wt") as f:
        json.dump({"sizes": sizes, "eager": eager(workload, sizes)}, f)
    for b in backends:
        for m in args.modes.split(","):
            torch.cuda.memory._record_memory_history(enabled=None)  # a fresh event buffer per capture
            torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=2_000_000)
            row = capture(workload, b, m, sizes)
            with gzip.open(out / f"trace-{args.model}-{b}-{m}.json.gz", "wt") as f:
                json.dump(row, f)
            print(f"{b}/{m}: graph {row['graph_bytes'] / 2**20:.1f} MiB, reserved {row['reserved_bytes'] / 2**20:.1f} MiB, "
                  f"{sum(len(k['events']) for k in row['keys'])} events, {row['seconds']:.1f} s", flush=True)
    torch.cuda.memory._record_memory_history(enabled=None)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
