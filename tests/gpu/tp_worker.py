"""Tensor-parallel capture with output sharing, one process per rank (``test_two_gpu.py``).

``python -m torch.distributed.run --standalone --nproc-per-node 2 tests/gpu/tp_worker.py [flags]``

Each rank holds a column/row-parallel shard of the bench's synthetic decoder: the attention heads
and the MLP columns are split across ranks; ``o_proj`` and ``down`` are row-parallel, each followed
by an all-reduce *inside the captured forward* (``torch.ops.sglang_bcg_tp.all_reduce``, an opaque
in-place op around ``dist.all_reduce``, as SGLang's ``inplace_all_reduce``). The residual stream
(``hidden``) and the output are replicated.

Every rank runs the bench's own measurement (``sglang_bcg_plugin.bench.runner.run_variant``) for
each backend x variant: forecast, capture of the whole schedule largest first (a
``dist.barrier`` between warmup and capture, as SGLang's ``tp_group.barrier()``), graph memory
(the device-wide free-memory delta, each rank on its own GPU), new inputs, replay == eager at
every size, replay time. Then the ranks compare: the same output bytes (the analytic sharing
saving), and the same outputs (an eager forward's checksum). Rank 0 writes
``$SGLANG_BCG_GPU_RESULTS_DIR/two_gpu_tp.json`` (every rank's rows) and prints one line per row;
any failure on any rank makes every rank exit 1.

Defaults: on CUDA the bench shapes (hidden 2880, 48 query / 8 KV heads of 64, intermediate 2880,
4 layers, bf16, SGLang's 74 prefill sizes up to 16384 tokens), NCCL, backends breakable, full,
piecewise and variants off, on, released. ``SGLANG_BCG_TP_DEVICE=cpu`` runs the same code on CPU
(gloo, the eager engine, small shapes): CI runs it there.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sglang_bcg_plugin.bench.config import DTYPES
from sglang_bcg_plugin.bench.model import DecoderConfig, SyntheticDecoder, attention_break, attention_op
from sglang_bcg_plugin.bench.runner import VARIANTS, run_variant, warm_up
from sglang_bcg_plugin.bench.sizes import prefill_capture_sizes
from sglang_bcg_plugin.bench.workload import ModelShape, Workload

BACKENDS = ("breakable", "full", "piecewise")
TP_VARIANTS = ("off", "on", "released")


@torch.library.custom_op("sglang_bcg_tp::all_reduce", mutates_args=("x",))
def all_reduce(x: torch.Tensor) -> None:
    """Sum ``x`` over the TP group in place (opaque to dynamo, so the piecewise backend keeps it)."""
    dist.all_reduce(x)


@all_reduce.register_fake
def _(x: torch.Tensor) -> None:
    return None


def inplace_all_reduce(x: torch.Tensor) -> torch.Tensor:
    all_reduce(x)
    return x


def tp_decoder(shape: ModelShape, rank: int, world: int, attention: Any, reduce: Any = inplace_all_reduce) -> SyntheticDecoder:
    """One rank's shard of the bench decoder (``reduce=None``: no all-reduce, for one rank
    holding every weight; on a group of one rank the all-reduce is still a real collective)."""
    cfg = DecoderConfig(shape.hidden, shape.layers, shape.heads, shape.kv_heads, shape.intermediate, shape.dtype,
                        shape.device, head_dim=shape.head_dim)
    return SyntheticDecoder(cfg, attention, rank=rank, world=world, reduce=reduce)


class TPWorkload(Workload):
    """The bench's workload interface over :func:`tp_decoder`; inputs are replicated (seeded)."""

    name = "tp-synthetic"

    def __init__(self, shape: ModelShape, rank: int, world: int) -> None:
        super().__init__(shape)
        self.rank, self.world = rank, world
        self.splitting_ops = (torch.ops.sglang_bcg_bench.attention.default,)
        self._inputs = torch.Generator().manual_seed(1)  # advances identically on every rank

    def model_for(self, backend: str, max_tokens: int) -> SyntheticDecoder:
        return tp_decoder(self.shape, self.rank, self.world, attention_break if backend == "breakable" else attention_op)

    def _random(self, max_tokens: int) -> torch.Tensor:
        return torch.randn(max_tokens, self.shape.hidden, generator=self._inputs).to(self.shape.dtype).to(self.shape.device)

    def static_input(self, max_tokens: int) -> torch.Tensor:
        return self._random(max_tokens)

    def refill(self, static: torch.Tensor) -> None:
        static.copy_(self._random(static.shape[0]))

    def call(self, fn: Any, static: torch.Tensor, size: int) -> Any:
        return fn(static[:size])


def parse_args(argv: list[str], cuda: bool) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=2880 if cuda else 64)
    p.add_argument("--heads", type=int, default=48 if cuda else 4)
    p.add_argument("--kv-heads", type=int, default=8 if cuda else 2)
    p.add_argument("--head-dim", type=int, default=64 if cuda else 16)
    p.add_argument("--intermediate", type=int, default=2880 if cuda else 128)
    p.add_argument("--layers", type=int, default=4 if cuda else 2)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16" if cuda else "float32")
    p.add_argument("--max-tokens", type=int, default=16384 if cuda else 64)
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--variants", default=",".join(TP_VARIANTS))
    p.add_argument("--repeats", type=int, default=20 if cuda else 2)
    p.add_argument("--no-forecast", action="store_true", help="skip each row's forecast (CUDA)")
    p.add_argument("--tolerance", type=float, default=None, help="replay vs eager max abs error (default: by dtype)")
    p.add_argument("--record-probes", type=Path, default=None, metavar="OUT.json.gz",
                   help="rank 0 also writes each row's forecast probes (tests/gpu/record_probes.py's format)")
    args = p.parse_args(argv)
    for flag, names, known in (("--backends", args.backends, BACKENDS), ("--variants", args.variants, VARIANTS)):
        bad = sorted(set(names.split(",")) - set(known))
        if bad:
            p.error(f"{flag}: unknown {', '.join(bad)}; choose from {', '.join(known)}")
    return args


def tolerance(dtype: torch.dtype) -> float:
    """Replay against eager: the same kernels on the same inputs (1e-4 fp32; one bf16/fp16 ulp at 1)."""
    return 1e-4 if dtype == torch.float32 else 1e-2


def check_row(row: dict[str, Any], sizes: list[int], shape: ModelShape, tol: float, failures: list[str], rank: int) -> None:
    """One rank's row: replay == eager, nothing fell back or bridged, the outputs the mode keeps."""
    name = f"rank {rank} {row['backend']}/{row['variant']}"
    if row["max_abs_err"] is not None and row["max_abs_err"] > tol:
        failures.append(f"{name}: replay != eager (max abs error {row['max_abs_err']:.3g})")
    if row["fallbacks"] or row["bridge_bytes"]:
        failures.append(f"{name}: {row['fallbacks']} fallbacks, {row['bridge_bytes']} bridge bytes")
    one = shape.hidden * shape.dtype.itemsize
    # released outputs live in the graph pool (nothing resident), but for the largest one where
    # the forecast found keeping it packs the pool tighter; the eager engine has no pool and keeps
    # them, as "off" does
    keeps = ((row.get("forecast") or {}).get("modes") or {}).get("released", {}).get("keeps_largest", False)
    released = (max(sizes) * one if keeps else 0) if shape.device.startswith("cuda") else sum(sizes) * one
    expected = {"off": sum(sizes) * one, "on": max(sizes) * one, "released": released}[row["output_mode"]]
    if row["logical_output_bytes"] != sum(sizes) * one or row["resident_output_bytes"] != expected:
        failures.append(
            f"{name}: outputs {row['resident_output_bytes']} resident / {row['logical_output_bytes']} logical bytes, "
            f"expected {expected} / {sum(sizes) * one}"
        )


def eager_checks(workload: TPWorkload, backends: list[str], max_tokens: int) -> tuple[dict[str, float], float]:
    """Each backend's model run eagerly on one input at the largest size, as checksums (every rank
    and every backend's model must agree), and the mean absolute difference of the first one's
    output from the unsplit model's (one rank holding every weight: the split is a TP split)."""
    x = workload.static_input(max_tokens)
    with torch.no_grad():
        outs = {b: workload.model_for(b, max_tokens)(x) for b in backends}
        whole = tp_decoder(workload.shape, 0, 1, attention_op, reduce=None)(x)
        unsplit = float((outs[backends[0]].float() - whole.float()).abs().mean())
    return {b: float(o.double().sum()) for b, o in outs.items()}, unsplit


def measure(
    args: argparse.Namespace, shape: ModelShape, sizes: list[int], backends: list[str], variants: list[str],
    tol: float, rank: int, world: int, failures: list[str], started: float,
) -> list[dict[str, Any]]:
    """This rank's bench rows, every backend x variant (each checked: :func:`check_row`)."""
    workload = TPWorkload(shape, rank, world)
    workload.post_warmup_hook = dist.barrier  # SGLang: tp_group.barrier() between warmup and capture
    warm_up(workload, backends, sizes)
    rows = []
    for backend in backends:
        for variant in variants:
            row = run_variant(
                backend, variant, workload, sizes, repeats=args.repeats, progress=False,
                forecast=shape.device.startswith("cuda") and not args.no_forecast,
            ).to_dict()
            row.pop("per_size")
            row["rank"] = rank
            check_row(row, sizes, shape, tol, failures, rank)
            rows.append(row)
            if rank == 0:
                graph = row["graph_memory_bytes"]
                print(
                    f"[{time.perf_counter() - started:6.1f} s] rank 0 {backend}/{variant}: graph "
                    f"{'-' if graph is None else f'{graph / 2**20:.1f} MiB'}, replay {row['replay_ms']:.3f} ms, "
                    f"max abs err {row['max_abs_err']}"
                    + ("" if row["forecast_bytes"] is None else f", forecast {row['forecast_bytes'] / 2**20:.1f} MiB"),
                    flush=True,
                )
    return rows


def write_probes(path: Path, rows: list[dict[str, Any]], forecasts: list[dict[str, Any]]) -> None:
    """Rank 0's forecast probes, one case per row, as ``record_probes.py`` writes them."""
    rows = [r for r in rows if r.get("forecast")]
    data = {
        "machine": f"{torch.cuda.get_device_name()}, torch {torch.__version__}; tests/gpu/tp_worker.py --record-probes",
        "cases": {
            f"tp-synthetic/{r['backend']}/{r['variant']}": {
                **fc,
                "measured": {r["variant"]: {"graph_bytes": r["graph_memory_bytes"], "forecast_bytes": r["forecast_bytes"],
                                            "mode": r["forecast"]["mode"], "forecast": r["forecast"]}},
            }
            for r, fc in zip(rows, forecasts, strict=True)
        },
    }
    with gzip.open(path, "wt") as f:
        json.dump(data, f)


def main(argv: list[str] | None = None) -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    on_cpu = os.environ.get("SGLANG_BCG_TP_DEVICE") == "cpu"
    args = parse_args(sys.argv[1:] if argv is None else argv, cuda=not on_cpu)
    if on_cpu:
        device = "cpu"
        dist.init_process_group("gloo")
    else:
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    shape = ModelShape(
        hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
        intermediate=args.intermediate, dtype=DTYPES[args.dtype], device=device,
    )
    sizes = prefill_capture_sizes(args.max_tokens)
    backends, variants = args.backends.split(","), args.variants.split(",")
    tol = tolerance(shape.dtype) if args.tolerance is None else args.tolerance
    failures: list[str] = []
    started = time.perf_counter()
    recorder = contextlib.nullcontext([])
    if args.record_probes is not None and rank == 0:
        from record_probes import recording

        recorder = recording()
    try:
        with recorder as forecasts:
            rows = measure(args, shape, sizes, backends, variants, tol, rank, world, failures, started)
        if forecasts:
            write_probes(args.record_probes, rows, forecasts)
        elif args.record_probes is not None and rank == 0:
            print("--record-probes: no row forecast (CPU, or --no-forecast): nothing written", flush=True)
        workload = TPWorkload(shape, rank, world)
        checksums, unsplit = eager_checks(workload, backends, max(sizes))
        if unsplit > tolerance(shape.dtype) / 10:  # a mean over every element, not a max
            failures.append(f"rank {rank}: the TP forward is {unsplit:.3g} from the unsplit model (mean abs)")
    except Exception as exc:  # noqa: BLE001 - the other rank may wait in a collective: report and leave
        failures.append(f"rank {rank}: {type(exc).__name__}: {exc}")
        print("\n".join(failures), file=sys.stderr, flush=True)
        os._exit(1)
    gathered: list[Any] = [None] * world
    for r in rows:
        r.pop("forecast", None)  # every mode's parts: the probes file has them
    dist.all_gather_object(gathered, {"rows": rows, "failures": failures, "checksums": checksums, "unsplit": unsplit})
    merged = [f for g in gathered for f in g["failures"]]
    sums = [g["checksums"][b] for g in gathered for b in backends]
    if any(abs(s - sums[0]) > tolerance(shape.dtype) * max(1.0, abs(sums[0])) for s in sums):  # not --tolerance
        merged.append(f"ranks or backends compute different outputs: {[g['checksums'] for g in gathered]}")
    by_row: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for g in gathered:
        for r in g["rows"]:
            by_row.setdefault((r["backend"], r["variant"]), []).append(r)
    for (b, v), per_rank in by_row.items():
        if len({r["resident_output_bytes"] for r in per_rank}) != 1:
            merged.append(f"{b}/{v}: ranks hold different output bytes {[r['resident_output_bytes'] for r in per_rank]}")
    if rank == 0:
        payload = {
            "world_size": world,
            "device": torch.cuda.get_device_name(local) if not on_cpu else "cpu",
            "backend_nccl": not on_cpu,
            "sizes": sizes,
            "model": {k: (str(v) if k == "dtype" else v) for k, v in vars(shape).items()},
            "rows": [r for g in gathered for r in g["rows"]],
            "checksums": [g["checksums"] for g in gathered],
            "unsplit_mean_abs_err": [g["unsplit"] for g in gathered],
            "failures": merged,
            "passed": not merged,
            "seconds": time.perf_counter() - started,
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
