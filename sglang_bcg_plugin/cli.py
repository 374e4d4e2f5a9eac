"""``sglang-bcg``: ``bench`` (the main job), ``backends``, ``doctor``."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def _positive(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        msg = f"expected a positive integer, got {value!r}"
        raise argparse.ArgumentTypeError(msg) from None
    if n < 1:
        msg = f"expected a positive integer, got {value!r}"
        raise argparse.ArgumentTypeError(msg)
    return n


def _bench_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("bench", help="capture a model at SGLang's prefill sizes with each backend, sharing off and on")
    p.add_argument("--model", choices=("synthetic", "llama"), default="synthetic",
                   help="synthetic: our tokens-first decoder (default); llama: transformers' LlamaModel with random weights")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--backends", default="breakable,full,piecewise", help="comma-separated backend names; graph-trees: torch.compile's reduce-overhead reference row")
    p.add_argument("--variants", default=None, help="comma-separated of off,on,floor,guard,adopt,reserve,inductor (default: off,on; plus floor,guard on CUDA)")
    p.add_argument("--hidden", type=_positive, default=None, help="hidden size (default: 2880 on CUDA, 128 on CPU)")
    p.add_argument("--layers", type=_positive, default=None, help="decoder layers (default: 4 on CUDA, 2 on CPU)")
    p.add_argument("--heads", type=_positive, default=None, help="attention heads (default: 45 on CUDA, 4 on CPU; llama: 64 / 4)")
    p.add_argument("--kv-heads", type=_positive, default=None, help="key/value heads (default: 5 on CUDA, 2 on CPU; llama: 8 / 2)")
    p.add_argument("--head-dim", type=_positive, default=None, help="llama only: head size (default: 64 on CUDA, 16 on CPU)")
    p.add_argument("--intermediate", type=_positive, default=None, help="MLP width (default: hidden, as gpt-oss-20b experts)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--max-tokens", type=_positive, default=None, help="largest capture size (default: 16384 on CUDA, 256 on CPU)")
    p.add_argument("--repeats", type=_positive, default=None, help="replays timed at the largest size (default: 50 on CUDA, 10 on CPU)")
    p.add_argument("--out", type=Path, default=None, help="directory for bench.json and bench.png")
    p.add_argument("--no-progress", action="store_true", help="hide the capture progress bar")


def _bench(args: argparse.Namespace) -> int:
    from .bench.output import format_table, write_json, write_plot
    from .bench.reference import GRAPH_TREES, graph_trees_row, variants_for
    from .bench.runner import VARIANTS, run_variant, warm_up
    from .bench.sizes import prefill_capture_sizes
    from .bench.workload import WORKLOADS, ModelShape
    from .registry import available_backends

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("error: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    gpu = device.startswith("cuda")
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = sorted(set(backends) - set(available_backends()) - {GRAPH_TREES})
    if unknown:
        print(f"error: unknown backends {unknown}; available: {', '.join([*available_backends(), GRAPH_TREES])}", file=sys.stderr)
        return 2
    variants = [v.strip() for v in (args.variants or ("off,on,floor,guard" if gpu else "off,on")).split(",") if v.strip()]
    bad = sorted(set(variants) - set(VARIANTS))
    if bad:
        print(f"error: unknown variants {bad}; choose from {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    llama = args.model == "llama"
    hidden = args.hidden or (2880 if gpu else (64 if llama else 128))
    heads = args.heads or ((64 if llama else 45) if gpu else 4)
    shape = ModelShape(
        hidden=hidden,
        layers=args.layers or (4 if gpu else 2),
        heads=heads,
        kv_heads=args.kv_heads or ((8 if llama else 5) if gpu else 2),
        head_dim=args.head_dim or ((64 if gpu else 16) if llama else hidden // heads),
        intermediate=args.intermediate or hidden,
        dtype=_DTYPES[args.dtype or ("bfloat16" if gpu else "float32")],
        device=device,
    )
    try:
        workload = WORKLOADS[args.model](shape)
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sizes = prefill_capture_sizes(args.max_tokens or (16384 if gpu else (64 if llama else 256)))
    repeats = args.repeats or (50 if gpu else 10)
    config = {
        "model": args.model, "hidden": shape.hidden, "layers": shape.layers, "heads": shape.heads,
        "kv_heads": shape.kv_heads, "head_dim": shape.head_dim,
        "intermediate": shape.intermediate, "dtype": str(shape.dtype).removeprefix("torch."),
        "max_tokens": max(sizes), "num_sizes": len(sizes), "repeats": repeats,
        "backends": backends, "variants": variants, "torch": torch.__version__,
    }
    name = torch.cuda.get_device_name() if gpu else "cpu"
    print(f"sglang-bcg bench on {name}: {config}", file=sys.stderr)
    start = time.perf_counter()
    warm_up(workload, [b for b in backends if b != GRAPH_TREES])  # the reference compiles afresh
    rows = []
    for backend in backends:
        for variant in variants_for(backend, variants):
            t0 = time.perf_counter()
            if backend == GRAPH_TREES:
                row = graph_trees_row(workload, sizes, repeats=repeats, progress=not args.no_progress)
            else:
                row = run_variant(backend, variant, workload, sizes, repeats=repeats, progress=not args.no_progress)
            rows.append(row)
            print(f"  {backend}/{variant} done in {time.perf_counter() - t0:.1f} s: {row.to_dict()}", file=sys.stderr)
    print(format_table(rows))
    print(f"({time.perf_counter() - start:.1f} s)", file=sys.stderr)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        write_json(args.out / "bench.json", name, config, rows)
        write_plot(args.out / "bench.png", name, config, rows)
        print(f"wrote {args.out / 'bench.json'} and {args.out / 'bench.png'}", file=sys.stderr)
    return 0


def _backends(args: argparse.Namespace) -> int:
    from .manager import get_plugin_manager
    from .registry import build_registry

    registry = build_registry(get_plugin_manager())
    for name in registry.names():
        print(f"{name}\t{registry.plugin_of(name)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sglang-bcg", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    _bench_parser(sub)
    sub.add_parser("backends", help="list registered backends and the plugin of each")
    doctor = sub.add_parser("doctor", help="check the SGLang integration (version, hook targets, entry point, flag)")
    doctor.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING)
    if args.command == "bench":
        return _bench(args)
    if args.command == "backends":
        return _backends(args)
    from .integration.doctor import doctor_main

    return doctor_main(args.rest)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
