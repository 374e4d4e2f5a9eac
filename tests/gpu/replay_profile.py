"""One replay at the largest size, profiled: Inductor Piecewise against Inductor Full (issue 21).

``python3 tests/gpu/replay_profile.py [--tokens 16384] [--dynamic auto,unbacked] [--out DIR]``
captures transformers'
``LlamaModel`` (the bench's CUDA shapes) at one size with each backend, Inductor-compiled and
sharing on, then runs ``torch.profiler`` over 5 replays of each and prints, per backend: the
replay's median wall ms, kernels launched per replay, device time per replay, memcpy/memset
launches, and the kernels whose device time differs most between the first Piecewise run and
Full. ``--dynamic`` lists Piecewise's ``compile(dynamic=...)`` modes, one run each. Writes
``replay_profile.json`` under ``--out``. A measurement to explain a gap, not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from sglang_bcg_plugin import BackendOptions, ShapeKey, create_backend
from sglang_bcg_plugin.bench.workload import LlamaWorkload, ModelShape

REPLAYS = 5


def inductor_backend(
    name: str, workload: LlamaWorkload, tokens: int, mode: str = "on", dynamic: str = "auto"
) -> tuple[Any, Any, Any]:
    """A fresh backend with the model compiled by Inductor (Piecewise: every piece; Full: the
    model, ``torch.compile(dynamic=True)``), its compiled callable and the static input."""
    torch._dynamo.reset()
    kwargs: dict[str, Any] = {}
    if name == "piecewise":
        kwargs = {"splitting_ops": list(workload.splitting_ops), "inductor": True}
    backend = create_backend(name, options=BackendOptions(output_mode=mode, engine="cuda"), **kwargs)
    model, static = workload.model_for(name, tokens), workload.static_input(tokens)
    fn = backend.compile(model, dynamic_dim=workload.dynamic_dim, dynamic=dynamic)  # Full: ignored
    if name == "full":
        fn = torch.compile(model, dynamic=True)
    return backend, fn, static


def capture(name: str, workload: LlamaWorkload, tokens: int, dynamic: str = "auto") -> tuple[Any, Any]:
    backend, fn, static = inductor_backend(name, workload, tokens, dynamic=dynamic)
    with torch.no_grad(), backend.capture_session():
        backend.capture_one(ShapeKey(tokens), lambda: workload.call(fn, static, tokens), capture_inputs=static)
    return backend, ShapeKey(tokens)


def kernels(prof: Any) -> dict[str, float]:
    """Device microseconds per kernel name over the profiled replays."""
    out: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.name] += e.device_time
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--out", default=".")
    ap.add_argument("--dynamic", default="auto", help="Piecewise: comma-separated compile(dynamic=...) modes")
    args = ap.parse_args()
    workload = LlamaWorkload(ModelShape(2880, 4, 64, 8, 64, 2880, torch.bfloat16, "cuda"))
    result: dict[str, Any] = {}
    runs = [(f"piecewise-{d}", "piecewise", d) for d in args.dynamic.split(",")] + [("full", "full", "unbacked")]
    for label, name, dynamic in runs:
        backend, key = capture(name, workload, args.tokens, dynamic)
        with torch.no_grad():
            for _ in range(3):
                backend.replay(key)
            torch.cuda.synchronize()
            walls = []
            for _ in range(20):
                t = time.perf_counter()
                backend.replay(key)
                torch.cuda.synchronize()
                walls.append((time.perf_counter() - t) * 1e3)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(REPLAYS):
                    backend.replay(key)
                torch.cuda.synchronize()
        per = kernels(prof)
        launches = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
        copies = {n: t for n, t in per.items() if "memcpy" in n.lower() or "memset" in n.lower()}
        result[label] = {"wall_ms": statistics.median(walls), "device_ms": sum(per.values()) / REPLAYS / 1e3,
                        "launches": launches / REPLAYS, "copy_ms": sum(copies.values()) / REPLAYS / 1e3,
                        "kernels_ms": {n: t / REPLAYS / 1e3 for n, t in sorted(per.items(), key=lambda kv: -kv[1])}}
        r = result[label]
        print(f"{label}: wall {r['wall_ms']:.3f} ms, device {r['device_ms']:.3f} ms, {r['launches']:.0f} device "
              f"events per replay, copies {r['copy_ms']:.3f} ms", flush=True)
        for n, ms in list(r["kernels_ms"].items())[:12]:
            print(f"   {ms:8.3f} ms  {n[:110]}")
        print(f"   {len(r['kernels_ms'])} distinct kernels; triton {sum(t for n, t in r['kernels_ms'].items() if n.startswith('triton')):.3f} ms")
        backend.cleanup()
    a, b = result[runs[0][0]]["kernels_ms"], result["full"]["kernels_ms"]
    diff = sorted(((a.get(n, 0.0) - b.get(n, 0.0), n) for n in set(a) | set(b)), key=lambda d: -abs(d[0]))
    print("largest differences (piecewise - full, ms per replay):")
    for d, n in diff[:15]:
        print(f"   {d:+8.3f}  {n[:110]}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "replay_profile.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
