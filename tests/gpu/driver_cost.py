"""What CUDA graphs cost outside PyTorch's allocator: the driver's memory per graph and per node.

``python3 tests/gpu/driver_cost.py [--out DIR]`` runs one fresh interpreter per graph shape
(kernel nodes per graph: elementwise kernels, memcpy nodes, cuBLAS GEMMs) and, in each, captures
graphs one after another into one pool, reading after 1, 2, 4, ... graphs:

* ``lost``: the free device memory the process gave up since just before its first capture
  (``cudaMemGetInfo``: what SGLang logs as "mem usage");
* ``reserved``: the growth of PyTorch's reserved bytes over the same span;
* ``driver = lost - reserved``: what the driver took for the instantiated graphs, the capture
  stream and anything else outside the caching allocator.

The first reading holds what a process pays once (the first capture's stream, the graph
machinery); the slope over later readings is per graph, and across shapes per node. Prints one
line per reading and writes ``driver_cost.json`` under ``--out``. A measurement for the
forecast's driver term, not a test.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

MIB = 1 << 20
#: (label, kind, nodes per graph)
SHAPES = [
    ("add1", "add", 1), ("add4", "add", 4), ("add16", "add", 16), ("add64", "add", 64),
    ("add256", "add", 256), ("copy16", "copy", 16), ("mm16", "mm", 16),
]
COUNTS = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def _child(kind: str, nodes: int) -> list[dict[str, Any]]:
    import torch

    dev = torch.device("cuda")
    x = torch.ones(1024, 1024, device=dev)
    y = torch.empty_like(x)
    w = torch.randn(1024, 1024, device=dev)

    def body() -> None:
        for _ in range(nodes):
            if kind == "add":
                x.add_(1.0)
            elif kind == "copy":
                y.copy_(x)
            else:
                torch.mm(x, w, out=y)

    body()  # eager once: kernels loaded, cuBLAS handle and workspace made outside any capture
    torch.cuda.synchronize()
    pool = torch.cuda.graph_pool_handle()
    graphs: list[Any] = []
    free0 = torch.cuda.mem_get_info()[0]
    reserved0 = torch.cuda.memory_reserved()
    rows = []
    for count in range(1, COUNTS[-1] + 1):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            body()
        graphs.append(g)
        if count in COUNTS:
            torch.cuda.synchronize()
            lost = free0 - torch.cuda.mem_get_info()[0]
            reserved = torch.cuda.memory_reserved() - reserved0
            rows.append({"graphs": count, "lost_mib": lost / MIB, "reserved_mib": reserved / MIB,
                         "driver_mib": (lost - reserved) / MIB})
    graphs[0].replay()
    torch.cuda.synchronize()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="out")
    ap.add_argument("--child", nargs=2, metavar=("KIND", "NODES"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child[0], int(args.child[1]))))
        return 0
    results: dict[str, Any] = {}
    for label, kind, nodes in SHAPES:
        proc = subprocess.run([sys.executable, __file__, "--child", kind, str(nodes)],
                              capture_output=True, text=True, timeout=300)
        if proc.returncode:
            print(f"{label}: failed\n{proc.stderr[-2000:]}", flush=True)
            results[label] = {"error": proc.stderr[-2000:]}
            continue
        rows = json.loads(proc.stdout.strip().splitlines()[-1])
        results[label] = {"kind": kind, "nodes": nodes, "rows": rows}
        for r in rows:
            print(f"{label:7} graphs {r['graphs']:4}  lost {r['lost_mib']:8.1f}  reserved {r['reserved_mib']:8.1f}  "
                  f"driver {r['driver_mib']:7.1f} MiB", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "driver_cost.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
