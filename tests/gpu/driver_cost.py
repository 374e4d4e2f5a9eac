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
    # kernels with other parameter blocks: strided (TensorIterator's offset calculator), Triton
    # kernels with few and with many arguments, small GEMMs (cuBLASLt's other kernels)
    ("strided16", "strided", 16), ("triton16", "triton", 16), ("triton_wide16", "triton_wide", 16),
    ("mm_small16", "mm_small", 16),
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
            elif kind == "strided":
                x.t().add_(1.0)
            else:
                torch.mm(x, w, out=y)

    if kind.startswith("triton"):
        body = _triton_body(kind, nodes, x, y)
    elif kind == "mm_small":
        xs, ws, ys = x[:8, :512], w[:512, :256], torch.empty(8, 256, device=dev)

        def body() -> None:
            for _ in range(nodes):
                torch.mm(xs, ws, out=ys)
    body()  # eager once: kernels loaded, cuBLAS handle and workspace made outside any capture
    torch.cuda.synchronize()
    pool = torch.cuda.graph_pool_handle()
    graphs: list[Any] = []
    free0 = torch.cuda.mem_get_info()[0]
    reserved0 = torch.cuda.memory_reserved()
    rows: list[dict[str, Any]] = []
    census = None
    for count in range(1, COUNTS[-1] + 1):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            body()
            if census is None:
                try:
                    from graph_census import census as read_census

                    census = read_census()
                except Exception as exc:  # noqa: BLE001 - a diagnostic
                    census = {"error": repr(exc)}
        graphs.append(g)
        if count in COUNTS:
            torch.cuda.synchronize()
            lost = free0 - torch.cuda.mem_get_info()[0]
            reserved = torch.cuda.memory_reserved() - reserved0
            rows.append({"graphs": count, "lost_mib": lost / MIB, "reserved_mib": reserved / MIB,
                         "driver_mib": (lost - reserved) / MIB, "census": census if count == 1 else None})
    graphs[0].replay()
    torch.cuda.synchronize()
    return rows


def _triton_body(kind: str, nodes: int, x: Any, y: Any) -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(p, n, BLOCK: tl.constexpr):  # noqa: N803
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(p + i, tl.load(p + i, mask=i < n) + 1.0, mask=i < n)

    @triton.jit
    def wide(o, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15,  # noqa: PLR0913
             s0, s1, s2, s3, s4, s5, s6, s7, n, BLOCK: tl.constexpr):  # noqa: N803
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        acc = tl.load(a0 + i, mask=m) + tl.load(a1 + i, mask=m) + tl.load(a2 + i, mask=m) + tl.load(a3 + i, mask=m)
        acc += tl.load(a4 + i, mask=m) + tl.load(a5 + i, mask=m) + tl.load(a6 + i, mask=m) + tl.load(a7 + i, mask=m)
        acc += tl.load(a8 + i, mask=m) + tl.load(a9 + i, mask=m) + tl.load(a10 + i, mask=m) + tl.load(a11 + i, mask=m)
        acc += tl.load(a12 + i, mask=m) + tl.load(a13 + i, mask=m) + tl.load(a14 + i, mask=m) + tl.load(a15 + i, mask=m)
        acc += s0 + s1 + s2 + s3 + s4 + s5 + s6 + s7
        tl.store(o + i, acc, mask=m)

    n = x.numel()
    grid = (triton.cdiv(n, 1024),)

    def body() -> None:
        for _ in range(nodes):
            if kind == "triton":
                add_one[grid](x, n, BLOCK=1024)
            else:
                wide[grid](y, *([x] * 16), *([1.0] * 8), n, BLOCK=1024)
    return body


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="out")
    ap.add_argument("--only", default="", help="comma-separated shape labels (default: all)")
    ap.add_argument("--child", nargs=2, metavar=("KIND", "NODES"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child[0], int(args.child[1]))))
        return 0
    results: dict[str, Any] = {}
    ap_only = args.only.split(",") if args.only else None
    for label, kind, nodes in SHAPES:
        if ap_only and label not in ap_only:
            continue
        proc = subprocess.run([sys.executable, __file__, "--child", kind, str(nodes)],
                              capture_output=True, text=True, timeout=300)
        if proc.returncode:
            print(f"{label}: failed\n{proc.stderr[-2000:]}", flush=True)
            results[label] = {"error": proc.stderr[-2000:]}
            continue
        rows = json.loads(proc.stdout.strip().splitlines()[-1])
        results[label] = {"kind": kind, "nodes": nodes, "rows": rows}
        print(f"{label}: census {rows[0].get('census')}", flush=True)
        for r in rows:
            print(f"{label:7} graphs {r['graphs']:4}  lost {r['lost_mib']:8.1f}  reserved {r['reserved_mib']:8.1f}  "
                  f"driver {r['driver_mib']:7.1f} MiB", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "driver_cost.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
