"""SGLang's real breakable engine, tensor parallel: one variant, one process per rank.

``python -m torch.distributed.run --standalone --nproc-per-node 2 tests/gpu/sglang_tp_worker.py VARIANT``

What ``sglang_gpu_driver.py`` measures on one GPU with a one-rank TP stand-in, here with SGLang's
own TP group: a ``GroupCoordinator`` built by SGLang's ``init_model_parallel_group`` over a real
process group (NCCL and gloo on CUDA, gloo on ``--device cpu``), with PyNccl for the all-reduce
as SGLang's TP group has by default on CUDA (``--no-pynccl``: torch.distributed's), and no custom
all-reduce (its kernels are ``sgl_kernel``'s, which cannot load here). That group is published
where the release reads it (``get_parallel().tp_group`` from 0.5.22, ``model_runner.tp_group``
before), so SGLang's ``BreakableCudaGraphBackend`` calls its real ``barrier()`` between warmup and
capture; the captures run inside its ``graph_capture()`` (the capture stream current, PyNccl
enabled), as SGLang's graph runners do.

The model is ``tp_worker.tp_decoder`` (the bench decoder sharded column/row-parallel): its
attention is SGLang's ``eager_on_graph`` break, its two all-reduces per layer are
``GroupCoordinator.all_reduce``, inside the captured segments. Inputs are replicated (seeded).
Variants are ``sglang_gpu_driver``'s: ``builtin`` (SGLang's class), ``floor``, ours ``off`` /
``on`` / ``released`` ... Every rank measures its own graph memory (the free-memory delta of its
own GPU) and replay == eager; rank 0 prints ``RESULT={json}`` with every rank's row.

``--gate DIR`` (used by :func:`run_tp_variants`): after the imports, each rank writes
``DIR/ready-VARIANT-RANK`` and waits for ``DIR/go-VARIANT`` before it touches a device, so every
variant's processes import SGLang side by side and then measure one variant at a time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

STARTED = time.perf_counter()
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path[:0] = [str(ROOT), str(HERE)]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from sglang_bcg_setup import (  # noqa: E402
    ENV_BUF, ENV_SHARE, Runner, Setup, import_sglang, install_sglang, one_output_bytes, report_result, sglang_attention,
)

#: the variants of ``sglang_gpu_driver.CAPTURE_VARIANTS`` that make sense per rank
VARIANTS = ("builtin", "floor", "off", "on", "on-adopt", "released")
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def tp_group(cuda: bool, world: int, local: int, pynccl: bool) -> Any:
    """SGLang's own TP ``GroupCoordinator`` over every rank of the default process group."""
    from sglang.srt.distributed import parallel_state as ps

    return ps.init_model_parallel_group(
        [list(range(world))], local, "nccl" if cuda else "gloo",
        use_pynccl=pynccl, use_custom_allreduce=False, group_name="tp",
    )


class TPSetup(Setup):
    """:class:`Setup` with SGLang's real TP group and one rank's shard of the decoder."""

    def __init__(self, opts: dict[str, Any], group: Any, rank: int, world: int) -> None:
        self.group, self.rank, self.world = group, rank, world
        self.barriers = 0
        real_barrier = group.barrier

        def barrier() -> None:  # SGLang's own barrier, counted (its backend calls it per size)
            self.barriers += 1
            real_barrier()

        group.barrier = barrier
        self._inputs = torch.Generator().manual_seed(1)  # replicated activations: the same on every rank
        super().__init__(opts)  # its warm forwards also make NCCL's buffers before any measurement

    def install(self) -> Any:
        server_args = install_sglang(self.cuda, tp_size=self.world)
        try:  # 0.5.22+: where SGLang's graph backend reads the TP group (install_sglang put the stand-in)
            from sglang.srt.runtime_context import get_parallel
        except ImportError:  # older: model_runner.tp_group (runner(), below)
            get_parallel = None
        parallel = get_parallel() if get_parallel is not None else None
        if hasattr(parallel, "override_permanently"):
            parallel.override_permanently(tp_group=self.group)
        return server_args

    def make_model(self) -> Any:
        from sglang_bcg_plugin.bench.workload import ModelShape
        from tp_worker import tp_decoder

        o = self.opts
        shape = ModelShape(
            hidden=int(o["hidden"]), layers=int(o["layers"]), heads=int(o["heads"]), kv_heads=int(o["kv_heads"]),
            head_dim=int(o["head_dim"]), intermediate=int(o["intermediate"]), dtype=self.dtype, device=self.device,
        )
        return tp_decoder(shape, self.rank, self.world, sglang_attention(), reduce=self.group.all_reduce)

    def make_input(self) -> torch.Tensor:
        return torch.randn(self.sizes[0], int(self.opts["hidden"]), generator=self._inputs).to(self.dtype).to(self.device)

    def refill(self) -> None:
        self.x.copy_(self.make_input())

    def runner(self, rows: Any = None) -> Runner:
        runner = super().runner(rows)
        runner.model_runner.tp_group = self.group  # where releases up to 0.5.21 read it
        return runner

    def capture(self, backend: Any, sizes: list[int], *, keep: bool = True, output: str = "tensor") -> None:
        """As SGLang's graph runners: inside the TP group's ``graph_capture`` (PyNccl enabled)."""
        with self.group.graph_capture(stream=self.stream) if self.cuda else contextlib.nullcontext():
            super().capture(backend, sizes, keep=keep, output=output)

    def device_name(self) -> str:
        return torch.cuda.get_device_name() if self.cuda else "cpu"


def _wait_for_go(gate: Path, variant: str, rank: int, timeout: float = 600) -> None:
    (gate / f"ready-{variant}-{rank}").touch()
    deadline = time.monotonic() + timeout
    while not (gate / f"go-{variant}").exists():
        if time.monotonic() > deadline:
            msg = f"no go for {variant} after {timeout:.0f} s"
            raise TimeoutError(msg)
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variant", choices=VARIANTS)
    ap.add_argument("--gate", type=Path, default=None, help="wait for DIR/go-VARIANT after the imports")
    ap.add_argument("--no-pynccl", action="store_true", help="all-reduce through torch.distributed, not PyNccl")
    ap.add_argument("--head-dim", type=int, default=64)
    Setup.add_arguments(ap)
    ap.set_defaults(heads=48, kv_heads=8)  # the bench's 45 / 5 heads do not split over two ranks
    args = ap.parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    for var in (ENV_SHARE, ENV_BUF):
        os.environ.pop(var, None)
    os.environ.update(NO_MULTICAST)
    import_sglang()
    from sglang_gpu_driver import capture_variant

    if args.gate is not None:
        _wait_for_go(args.gate, args.variant, rank)
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(local)
        args.device = f"cuda:{local}"
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    else:
        dist.init_process_group("gloo")
    group = tp_group(cuda, world, local, pynccl=cuda and not args.no_pynccl)
    setup = TPSetup(vars(args), group, rank, world)
    ready = time.perf_counter() - STARTED
    try:
        row = capture_variant(setup, args.variant)
    except Exception as exc:  # noqa: BLE001 - the other rank may wait in a collective: report and leave
        print(f"rank {rank} {args.variant}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        os._exit(1)
    row.update(rank=rank, pynccl=group.pynccl_comm is not None, barriers=setup.barriers, group=type(group).__name__,
               group_world_size=group.world_size)
    rows: list[Any] = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        meta = {"world_size": world, "one_output_bytes": one_output_bytes(setup), "device": setup.device_name(),
                "torch": torch.__version__, "setup_s": round(ready, 1), "total_s": round(time.perf_counter() - STARTED, 1)}
        print("RESULT=" + json.dumps({"meta": meta, "ranks": rows}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def run_tp_variants(variants: list[str], extra: list[str], *, nproc: int = 2, timeout: float = 300, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Each variant as its own ``nproc``-rank job; ``{variant: result}`` (``{"error": ...}`` for one that failed).

    Every job starts at once and imports SGLang side by side; when every rank of every job is
    ready, the jobs run one at a time, each after the previous one exited, so each rank's memory
    delta is its own job's alone.
    """
    child_env = {k: v for k, v in os.environ.items() if k not in (ENV_SHARE, ENV_BUF)}
    child_env.update(NO_MULTICAST)
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), child_env.get("PYTHONPATH", "")) if p)
    child_env.update(env or {})
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        gate = Path(tmp)
        jobs = {}
        for v in variants:
            log = (gate / f"{v}.log").open("w+")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                   str(Path(__file__)), v, "--gate", str(gate), *extra]
            jobs[v] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=child_env, cwd=str(ROOT)), log)
        deadline = time.monotonic() + timeout
        want = {f"ready-{v}-{r}" for v in variants for r in range(nproc)}
        while not want <= {p.name for p in gate.iterdir()} and time.monotonic() < deadline:
            if any(p.poll() is not None for p, _ in jobs.values()):
                break  # one failed before it was ready: it is reported below
            time.sleep(0.5)
        try:
            for v in variants:
                proc, log = jobs[v]
                (gate / f"go-{v}").touch()
                try:
                    rc = proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    rc = proc.wait()
                log.seek(0)
                text = log.read()
                line = next((ln for ln in text.splitlines() if ln.startswith("RESULT=")), None)
                if rc != 0 or line is None:
                    out[v] = {"variant": v, "error": f"rc={rc}", "log": text[-4000:]}
                else:
                    out[v] = json.loads(line[len("RESULT="):])
                report_result(v, out[v], "sglang_tp.jsonl", "sglang_tp_worker")
        finally:
            for proc, log in jobs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                log.close()
    return out


if __name__ == "__main__":
    sys.exit(main())
