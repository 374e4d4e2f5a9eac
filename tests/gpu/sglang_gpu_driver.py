"""One measurement variant per process on SGLang 0.5.23's real BCG engine (and our engines).

``python tests/gpu/sglang_gpu_driver.py VARIANT [--max-tokens N ...]`` prints one line
``RESULT={json}``. SGLang's graph pool and hooks are per process, so every SGLang variant runs
in a fresh interpreter (:func:`run_variants` starts them together for their imports, then lets
them measure one after another). What runs is
SGLang's own code: ``BreakableCudaGraphBackend`` (warmups, global graph pool, dedup plumbing,
``BreakableCUDAGraph`` segments, ``eager_on_graph`` breaks); the stand-ins are a one-rank TP
group (``barrier()`` synchronizes), a runner exposing ``model_runner.server_args``,
``device_module`` and the two row hooks, and the published ``ServerArgs``.

The model is the tokens-first synthetic decoder of ``sglang_bcg_plugin.bench.model``
(``[tokens, hidden]``; per layer RMSNorm, qkv, attention, o_proj, MLP) whose attention is an
SGLang ``eager_on_graph`` break writing into an output allocated inside the segment, as
``RadixAttention._eager_attention`` does. Variants: ``builtin`` (SGLang's class), ``floor``
(SGLang's class, every output released inside its graph: the forward returns ``None``), ours
``off`` / ``on`` (reserve) / ``on-adopt`` / ``default`` (no flag, no env) / ``released``,
``dataclass`` and ``builtin-dataclass`` (a ``LogitsProcessorOutput``, 8 sizes), ``recapture``
(cycles of capture / replay / cleanup, the mode changing every cycle) and
``builtin-recapture`` (SGLang's class captured again after its cleanup), and ``engines`` (our
own breakable and full engines, adopt vs reserve vs released vs floor, one process).

Memory is the ``torch.cuda.mem_get_info`` delta over the capture session after
``empty_cache``; replay is the median of ``--repeats`` replays of the largest size (CUDA
events); max abs err is replay vs the eager forward over every size after the input changed.
``--device cpu`` dry-runs the same code with the CPU graph stand-in of ``tests/sglang``.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

STARTED = time.perf_counter()
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path[:0] = [str(ROOT), str(HERE)]

import torch  # noqa: E402

from sglang_bcg_setup import ENV_BUF, ENV_SHARE, Setup, import_sglang, one_output_bytes, report_result  # noqa: E402

#: variant -> (backend class "builtin"/"ours", env, keep the output, output kind, sizes limit)
CAPTURE_VARIANTS: dict[str, tuple[str, dict[str, str], bool, str, int | None]] = {
    "builtin": ("builtin", {}, True, "tensor", None),
    "floor": ("builtin", {}, False, "tensor", None),
    "off": ("ours", {ENV_SHARE: "0"}, True, "tensor", None),
    "on": ("ours", {ENV_SHARE: "1"}, True, "tensor", None),
    "on-adopt": ("ours", {ENV_SHARE: "1", ENV_BUF: "adopt"}, True, "tensor", None),
    "default": ("ours", {}, True, "tensor", None),
    "released": ("ours", {ENV_SHARE: "released"}, True, "tensor", None),
    "dataclass": ("ours", {ENV_SHARE: "1"}, True, "logits", 8),
    "builtin-dataclass": ("builtin", {}, True, "logits", 8),
}
SPECIAL = ("recapture", "builtin-recapture", "engines")
ALL = (*CAPTURE_VARIANTS, *SPECIAL)


def _leaf(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.next_token_logits


def capture_variant(setup: Setup, name: str) -> dict[str, Any]:
    kind, env, keep, output, limit = CAPTURE_VARIANTS[name]
    os.environ.update(env)
    sizes = setup.sizes[:limit] if limit else setup.sizes
    backend = setup.backend(kind)
    row: dict[str, Any] = {"variant": name, "backend": kind, "num_sizes": len(sizes), "max_tokens": sizes[0]}
    before = setup.memory()
    start = time.perf_counter()
    try:
        setup.capture(backend, sizes, keep=keep, output=output)
    except Exception as exc:  # noqa: BLE001 - a refused output type is a finding
        row.update(error=f"{type(exc).__name__}: {exc}"[:400])
        return row
    row["capture_s"] = time.perf_counter() - start
    after = setup.memory()
    row.update(setup.memory_delta(before, after))
    mode = getattr(backend, "last_output_mode", None)
    row["mode"] = None if mode is None else mode.describe()
    if kind == "ours":
        report = backend.memory_report()
        row.update(resident_output_bytes=report.resident_output_bytes, logical_output_bytes=report.logical_output_bytes,
                   fallbacks=len(report.fallbacks))
        fc = getattr(backend, "_bcg_forecast", None)  # the forecast logged inside SGLang (0.5.14+)
        if fc is not None and fc.forecast is not None and limit is None:
            f = fc.forecast["modes"][fc.mode]  # the pool part against the pool; the whole against the free memory lost
            row.update(forecast_bytes=f.pool_bytes, forecast_measured_bytes=fc.measured,
                       forecast_total_bytes=f.total_bytes, forecast_driver_bytes=f.driver_bytes,
                       forecast_stream_bytes=f.stream_bytes, forecast_lost_bytes=fc.lost)
    if keep:
        setup.refill()
        row["max_abs_err"] = setup.max_error(backend, sizes, _leaf)
    row["replay_ms"] = setup.time_replay(backend, sizes[0])
    backend.cleanup()
    return row


def recapture(setup: Setup, cycles: int, probe: bool = False) -> dict[str, Any]:
    """``cycles`` x (capture every size, check, cleanup); the mode changes every cycle.

    ``probe``: first run :func:`plain_torch_graphs` and measure the cycles from the level after it.
    """
    modes = ("on", "off", "released")
    backend = setup.backend("ours")
    first = setup.memory()  # before this process captured any CUDA graph
    one_time = plain_torch_graphs(setup) if probe else {}
    base = setup.memory()  # before any of ours (after the plain graphs when probing)
    rows = []
    probe = [setup.sizes[0], setup.sizes[len(setup.sizes) // 2], setup.sizes[-1]]
    for i in range(cycles):
        os.environ[ENV_SHARE] = {"on": "1", "off": "0", "released": "released"}[modes[i % 3]]
        setup.capture(backend, setup.sizes, keep=True, output="tensor")
        held = setup.memory()
        setup.refill()
        err = setup.max_error(backend, probe, _leaf)
        backend.cleanup()
        end = setup.memory()
        rows.append({"cycle": i + 1, "mode": modes[i % 3], "max_abs_err": err,
                     "graph_bytes": base["free"] - held["free"],
                     "drift_free_bytes": base["free"] - end["free"],
                     "drift_reserved_bytes": end["reserved"] - base["reserved"]})
    # The hazardous path: capture again right after cleanup, no empty_cache in between.
    small = setup.sizes[-4:]
    os.environ[ENV_SHARE] = "1"
    setup.capture(backend, small, keep=True, output="tensor")
    backend.cleanup()
    os.environ[ENV_SHARE] = "0"
    setup.capture(backend, small, keep=True, output="tensor")
    setup.refill()
    again = setup.max_error(backend, small, _leaf)
    backend.cleanup()
    return {"variant": "recapture", "cycles": rows, "recapture_without_empty_cache_err": again,
            "one_time": {**one_time, "before_any_graph_free_bytes": first["free"],
                         "plain_torch_graphs_drift_free_bytes": first["free"] - base["free"],
                         "plain_torch_graphs_drift_reserved_bytes": base["reserved"] - first["reserved"]},
            "max_drift_free_bytes": max(abs(r["drift_free_bytes"]) for r in rows),
            "max_drift_reserved_bytes": max(abs(r["drift_reserved_bytes"]) for r in rows)}


def plain_torch_graphs(setup: Setup) -> dict[str, Any]:
    """What the process's first CUDA graphs cost outside any capture backend, step by step.

    Free memory after (1) one trivial graph (``x.add_(1)``) captured, replayed and destroyed;
    (2) one eager forward at every size of the schedule, on the capture stream (the kernels a
    shape needs are loaded on first use, ``CUDA_MODULE_LOADING=LAZY`` being torch's default, and
    stay loaded); (3) a plain ``torch.cuda.graph`` of the decoder at the largest size, then at
    the smallest, destroyed; (4) CUDA's graph-memory attributes (memory-node allocations, which
    torch's graphs do not use) before and after ``cudaDeviceGraphMemTrim``. The recapture
    cycles are measured from the level after these: what stays behind here is the driver's and
    the kernel libraries', not a backend's.
    """
    if not setup.cuda:
        return {}
    steps: dict[str, Any] = {"start_free": setup.memory()["free"]}
    x = torch.zeros(16, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        x.add_(1)
    g.replay()
    del g
    steps["after_trivial_graph_free"] = setup.memory()["free"]
    with torch.no_grad(), setup.on_stream():
        for size in setup.sizes:
            setup.model(setup.x[:size])
    steps["after_eager_every_size_free"] = setup.memory()["free"]
    for size in (setup.sizes[0], setup.sizes[-1]):
        g = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(g, stream=setup.stream):
            out = setup.model(setup.x[:size])
        g.replay()
        del g, out
        steps[f"after_plain_graph_{size}_free"] = setup.memory()["free"]
    # (3b) the whole schedule as plain graphs alive at once in one pool (largest first), as
    # many graphs as a capture session holds; then all destroyed.
    pool = torch.cuda.graph_pool_handle()
    held = []
    with torch.no_grad():
        for size in setup.sizes:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool, stream=setup.stream):
                setup.model(setup.x[:size])
            held.append(g)
    steps["plain_schedule_graphs"] = len(held)
    del held, g
    steps["after_plain_schedule_free"] = setup.memory()["free"]
    try:
        from cuda.bindings import runtime as rt

        attr = rt.cudaGraphMemAttributeType.cudaGraphMemAttrReservedMemCurrent
        steps["graph_mem_reserved_bytes"] = int(rt.cudaDeviceGetGraphMemAttribute(0, attr)[1])
        rt.cudaDeviceGraphMemTrim(0)
        steps["graph_mem_reserved_after_trim_bytes"] = int(rt.cudaDeviceGetGraphMemAttribute(0, attr)[1])
        steps["after_trim_free"] = setup.memory()["free"]
    except Exception as exc:  # noqa: BLE001 - a diagnostic only
        steps["graph_mem_error"] = f"{type(exc).__name__}: {exc}"[:200]
    steps["cuda_module_loading"] = os.environ.get("CUDA_MODULE_LOADING", "")
    return steps


def builtin_recapture(setup: Setup) -> dict[str, Any]:
    """SGLang's own class: capture the schedule, cleanup (free-memory drift), capture again."""
    backend = setup.backend("builtin")
    small = setup.sizes[:8]
    before = setup.memory()
    setup.capture(backend, setup.sizes, keep=True, output="tensor")  # the whole schedule, as ours
    backend.cleanup()
    after = setup.memory()
    errors = []
    for _ in range(2):
        try:
            setup.capture(backend, small[-2:], keep=True, output="tensor")
            errors.append(None)
        except Exception as exc:  # noqa: BLE001 - the finding
            errors.append(f"{type(exc).__name__}: {exc}"[:300])
    return {"variant": "builtin-recapture", "second_capture": errors[0], "third_capture": errors[1],
            "first_capture_drift_free_bytes": before["free"] - after["free"],
            "first_capture_drift_reserved_bytes": after["reserved"] - before["reserved"]}


def engines(setup: Setup) -> list[dict[str, Any]]:
    """Our own engines at the same shapes: adopt vs reserve vs released vs floor."""
    from sglang_bcg_plugin.bench import runner
    from sglang_bcg_plugin.bench.workload import ModelShape, SyntheticWorkload

    cfg = setup.decoder_config()
    shape = ModelShape(cfg.hidden, cfg.layers, cfg.heads, cfg.kv_heads, cfg.hidden // cfg.heads, cfg.intermediate,
                       cfg.dtype, cfg.device)
    workload = SyntheticWorkload(shape)
    rows = []
    for backend in ("breakable", "full"):
        runner.warm_up(workload, [backend])
        for variant in ("adopt", "reserve", "released", "floor"):
            row = runner.run_variant(backend, variant, workload, setup.sizes, repeats=setup.repeats, progress=False)
            rows.append(row.to_dict())
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variant", choices=ALL)
    ap.add_argument("--wait-go", action="store_true",
                    help="after the imports print READY and wait for a line on stdin (run_variants)")
    ap.add_argument("--one-time-probe", action="store_true",
                    help="recapture: plain torch graphs first, measured step by step (plain_torch_graphs)")
    Setup.add_arguments(ap)
    args = ap.parse_args(argv)
    for var in (ENV_SHARE, ENV_BUF):
        os.environ.pop(var, None)
    if args.wait_go:
        if args.variant != "engines":
            import_sglang()
        import sglang_bcg_plugin.bench.runner  # noqa: F401
        import sglang_bcg_plugin.sglang  # noqa: F401

        print("READY", flush=True)
        if not sys.stdin.readline():
            return 1
    setup = Setup.from_args(args, needs_sglang=args.variant != "engines")
    ready = time.perf_counter() - STARTED
    if args.variant == "recapture":
        result: Any = recapture(setup, args.cycles, probe=args.one_time_probe)
    elif args.variant == "builtin-recapture":
        result = builtin_recapture(setup)
    elif args.variant == "engines":
        result = engines(setup)
    else:
        result = capture_variant(setup, args.variant)
    meta = {"one_output_bytes": one_output_bytes(setup), "device": setup.device_name(), "torch": torch.__version__,
            "setup_s": round(ready, 1), "total_s": round(time.perf_counter() - STARTED, 1)}
    print("RESULT=" + json.dumps({"meta": meta, "result": result}), flush=True)
    return 0


def run_variants(variants: list[str], extra: list[str], *, timeout: float = 180, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Each variant in its own fresh interpreter; ``{variant: result}``.

    SGLang's import costs about 28 s a process, so every child is started at once and imports
    side by side (``--wait-go``: it prints ``READY`` after its imports, before it touches the
    device); only when all are ready does the parent let them run, one at a time, each after the
    previous one exited. A child's memory figures are deltas over its own capture, and while it
    measures every other child is either gone or blocked on its stdin with nothing allocated.
    """
    child_env = {k: v for k, v in os.environ.items() if k not in (ENV_SHARE, ENV_BUF)}
    child_env["SGLANG_BCG_FORECAST"] = "1"  # the forecast lines (opt-in), checked by test_graph_memory_vs_sglang_builtin
    child_env.update(env or {})
    procs: dict[str, subprocess.Popen[str]] = {}
    logs: dict[str, Any] = {}
    for variant in variants:
        logs[variant] = tempfile.TemporaryFile("w+")
        procs[variant] = subprocess.Popen(
            [sys.executable, str(Path(__file__)), variant, "--wait-go", *extra],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=logs[variant], text=True, env=child_env,
            cwd=str(ROOT),
        )
    readers = {v: _LineReader(p) for v, p in procs.items()}
    ready = {v: readers[v].wait_for("READY", timeout) for v in variants}  # all imported first
    out: dict[str, Any] = {}
    try:
        for variant in variants:
            proc = procs[variant]
            line = None
            if ready[variant] is not None:
                assert proc.stdin is not None
                proc.stdin.write("go\n")
                proc.stdin.flush()
                line = readers[variant].wait_for("RESULT=", timeout)
            try:
                rc = proc.wait(timeout=30 if line is not None else 1)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
            if line is None or rc != 0:
                logs[variant].seek(0)
                out[variant] = {"variant": variant, "error": f"rc={rc}", "stderr": logs[variant].read()[-3000:]}
                continue
            out[variant] = json.loads(line[len("RESULT="):])
            report_result(variant, out[variant], "sglang_engine.jsonl", "sglang_gpu_driver")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()
        for log in logs.values():
            log.close()
    return out


class _LineReader:
    """A child's stdout, read on a thread, so the parent can wait for a line with a timeout."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._pump, args=(proc,), daemon=True)
        self._thread.start()

    def _pump(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_for(self, prefix: str, timeout: float) -> str | None:
        """The first line starting with ``prefix``; ``None`` at end of output or after ``timeout``."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                return None
            if line is None:
                return None
            if line.startswith(prefix):
                return line
        return None


if __name__ == "__main__":
    sys.exit(main())
