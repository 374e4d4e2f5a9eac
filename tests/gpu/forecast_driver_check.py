"""The forecast with the CUDA driver's share against what a fresh process loses (issue 36).

``python3 tests/gpu/forecast_driver_check.py [--out DIR]`` runs, for each workload (the synthetic
decoder and transformers' Llama at the bench shapes: 74 sizes up to 16384 tokens, hidden 2880,
4 layers, bf16) x backend (full, breakable, piecewise) x output mode (released, on, off), one
fresh process (forked from a parent that never touched CUDA, so each has its own CUDA context;
``--spawn``: a new interpreter each) that

1. builds the model and its static input and runs one eager forward at the largest size (the
   kernels loaded, cuBLAS's handle made: before the measure, as ``tests/gpu/driver_cost.py`` does;
   what that cost is reported as ``eager_lost_bytes``);
2. reads the free device memory (``empty_cache`` first), forecasts the schedule
   (``backend.forecast``: two probe captures), captures it, and reads it again:
   ``lost_bytes``, the free device memory the process lost over forecast and capture (what
   SGLang's "mem usage" reads for its capture);
3. compares ``forecast_bytes`` (the configured mode's total, the driver's share included) with
   it, and the allocator's part with the session's own drop;
4. captures one graph of 16 ``add_`` kernels with the node count on (after the measure): the
   count must read 16 (``nodes_check``).

Prints one line per process and writes ``forecast_driver.json`` under ``--out`` (default
``$SGLANG_BCG_GPU_RESULTS_DIR``, else ``out``) after each. The processes run one after another
(free device memory is the whole device's); once ``--budget-s`` (default 200) has passed, none
is started and the rest are listed as skipped, so the run ends within four minutes. ``--schedule``
(``prefill``, ``pow2``, ``decode``) picks the sizes, ``--pool-reserve auto`` starts the pool as one
block; ``--models``, ``--backends``, ``--modes`` pick a subset. ``BCG_TRACE_SESSION=1`` keeps the
allocator's events of the capture session (``session_events``) and every segment's address at the
end (``pool_segment_addresses``). A measurement, not a test: it fails only if a process fails.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MIB = 1 << 20
MODELS = ("synthetic", "llama")
BACKENDS = ("full", "breakable", "piecewise")
MODES = ("released", "on", "off")


def _shape(model: str) -> Any:
    import torch

    from sglang_bcg_plugin.bench.workload import ModelShape

    if model not in ("synthetic", "llama"):  # a family of forecast_families.py: it fixes its shape
        return ModelShape(0, 0, 0, 0, 0, 0, torch.bfloat16, "cuda")
    if model == "synthetic":
        return ModelShape(2880, 4, 45, 5, 64, 2880, torch.bfloat16, "cuda")
    return ModelShape(2880, 4, 64, 8, 64, 2880, torch.bfloat16, "cuda")


def _nodes_check() -> dict[str, Any]:
    """One graph of 16 elementwise kernels, counted as the probes count."""
    import torch

    from sglang_bcg_plugin.forecast.driver import ProbeCount, counting_captures, driver_api

    x = torch.ones(1024, device="cuda")
    x.add_(1.0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with counting_captures() as count, torch.cuda.graph(g):
        for _ in range(16):
            x.add_(1.0)
    api, why = driver_api()
    seen = ProbeCount.of(16, count)
    return {"graphs": seen.graphs, "nodes": sum(n for n in count if n), "unread": count.count(None),
            "expected_nodes": 16, "ok": seen.graphs == 1 and seen.nodes == 16, "driver_api": api is not None, "why": why}


def _stack_bytes() -> int | None:
    """The context's per-thread stack limit (``cuCtxGetLimit(CU_LIMIT_STACK_SIZE)``): it grows when a
    kernel needing more local memory is launched, and the driver's local memory with it."""
    import ctypes

    try:
        value = ctypes.c_size_t(0)
        rc = ctypes.CDLL("libcuda.so.1").cuCtxGetLimit(ctypes.byref(value), 0)
        return int(value.value) if rc == 0 else None
    except OSError:
        return None


def _kept_segments() -> list[list[Any]]:
    """``[pool, stream, bytes, [live block bytes]]`` of every segment the allocator holds (read after
    ``empty_cache``: what it could not give back)."""
    import torch

    return [[list(seg.get("segment_pool_id", (0, 0))), int(seg["stream"]), int(seg["total_size"]),
             [int(b["size"]) for b in seg["blocks"] if b["state"] == "active_allocated"]]
            for seg in torch.cuda.memory._snapshot()["segments"]]


def schedule_sizes(schedule: str, max_tokens: int) -> list[int]:
    """The sizes of ``schedule``, largest first: ``prefill`` (SGLang's prefill capture list up to
    ``max_tokens``), ``pow2`` (1, 2, 4, ... up to it), ``decode`` (SGLang's default decode batch
    sizes, 1, 2, 4, 8, 12, then every 8th from 16, up to it and at most 512)."""
    from sglang_bcg_plugin.bench.sizes import prefill_capture_sizes

    if schedule == "prefill":
        sizes = prefill_capture_sizes(max_tokens)
    elif schedule == "pow2":
        sizes = [1 << k for k in range(max_tokens.bit_length()) if 1 << k <= max_tokens]
    elif schedule == "decode":
        top = min(max_tokens, 512)
        sizes = [n for n in (1, 2, 4, 8, 12, *range(16, top + 1, 8)) if n <= top]
    else:
        raise SystemExit(f"--schedule must be prefill, pow2 or decode, got {schedule!r}")
    return sorted(set(sizes), reverse=True)


def run_case(model: str, backend_name: str, mode: str, max_tokens: int, schedule: str = "prefill",
             pool_reserve: str = "off") -> dict[str, Any]:
    """One fresh process's measure (see the module doc)."""
    import torch

    from sglang_bcg_plugin import BackendOptions, ShapeKey, create_backend
    from sglang_bcg_plugin.accounting import device_free_bytes
    from forecast_families import WORKLOADS
    from record_probes import recording

    start = time.perf_counter()
    assert not torch.cuda.is_initialized(), "the parent initialized CUDA: not a fresh process"
    workload = WORKLOADS[model](_shape(model))
    sizes = schedule_sizes(schedule, max_tokens)
    kwargs: dict[str, Any] = {"splitting_ops": list(workload.splitting_ops)} if backend_name == "piecewise" else {}
    options = BackendOptions(output_mode=mode, engine="cuda", pool_reserve=pool_reserve)
    backend = create_backend(backend_name, options=options, **kwargs)
    model_fn = workload.model_for(backend_name, sizes[0])
    static = workload.static_input(sizes[0])
    fn = backend.compile(model_fn, dynamic_dim=workload.dynamic_dim)
    free_context = device_free_bytes()  # the context, the weights and the input made
    with torch.no_grad():
        workload.call(fn, static, sizes[0])  # kernels loaded, compiled (piecewise), cuBLAS's handle
        # BCG_WARM_SIZES=1 (a diagnostic): an eager forward at every size before the measure, so the
        # kernels only other sizes pick are loaded before it
        for n in sizes[1:] if os.environ.get("BCG_WARM_SIZES") == "1" else ():
            workload.call(fn, static, n)
    torch.cuda.synchronize()
    free_before = device_free_bytes()
    reserved_before = torch.cuda.memory_reserved()
    stacks = {"before": _stack_bytes()}
    kept = {"before": _kept_segments()}

    def forward_for(n: int) -> Any:
        return lambda: workload.call(fn, static, n)

    with recording() as probes:
        fc = backend.forecast(sizes, forward_for, capture_inputs=static)
    torch.cuda.synchronize()
    free_probed, reserved_probed = device_free_bytes(), torch.cuda.memory_reserved()
    stacks["probed"] = _stack_bytes()
    kept["probed"] = _kept_segments()
    trace_session = os.environ.get("BCG_TRACE_SESSION") == "1"
    if trace_session:  # a diagnostic: the allocator's events of the capture session, addresses included
        torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=1_000_000)
    with torch.no_grad(), backend.capture_session():
        for n in sizes:
            backend.capture_one(ShapeKey(n), forward_for(n), capture_inputs=static,
                                post_warmup_hook=workload.post_warmup_hook)
    session_events = None
    if trace_session:
        session_events = [[e["action"], int(e["addr"]), int(e["size"]), int(e.get("stream", 0))]
                          for e in torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]]
        torch.cuda.memory._record_memory_history(enabled=None)
    free_after = device_free_bytes()
    reserved_after = torch.cuda.memory_reserved()
    stacks["after"] = _stack_bytes()
    kept["after"] = _kept_segments()
    report = backend.memory_report()
    with torch.no_grad():
        backend.replay(ShapeKey(sizes[0]))
    torch.cuda.synchronize()
    lost = free_before - free_after
    f = fc.modes[fc.mode]
    row = {
        "model": model, "backend": backend_name, "mode": mode, "num_sizes": len(sizes), "max_tokens": sizes[0],
        "schedule": schedule, "pool_reserve": pool_reserve,
        "lost_bytes": lost, "eager_lost_bytes": free_context - free_before,
        "probe_phase_lost_bytes": free_before - free_probed, "session_lost_bytes": free_probed - free_after,
        "probe_phase_reserved_bytes": reserved_probed - reserved_before,
        "session_reserved_bytes": reserved_after - reserved_probed,
        "warm_sizes": os.environ.get("BCG_WARM_SIZES") == "1",
        "module_loading": os.environ.get("CUDA_MODULE_LOADING", ""), "stack_bytes": stacks,
        "kept_segments": kept, "session_events": session_events,
        "pool_segment_addresses": [[int(seg["address"]), int(seg["total_size"]), list(seg.get("segment_pool_id", (0, 0)))]
                                   for seg in torch.cuda.memory._snapshot()["segments"]],
        "session_drop_bytes": report.measured_graph_bytes, "report_lost_bytes": report.lost_bytes,
        "lasting_bytes": fc.lasting_bytes, "probe_driver_bytes": fc.probe_driver_bytes,
        "forecast_bytes": f.total_bytes, "allocator_bytes": f.allocator_bytes, "driver_bytes": f.driver_bytes,
        "pool_bytes": f.pool_bytes, "stream_bytes": f.stream_bytes,
        "forecast_error": (f.total_bytes - lost) / lost if lost else None,
        "allocator_error": report.allocator_error, "report_forecast_error": report.forecast_error,
        "driver": None if fc.driver is None else fc.driver.to_dict(), "caveat": fc.caveat,
        "forecast": fc.to_dict(), "probes": probes[0] if probes else None, "torch": torch.__version__, "device": torch.cuda.get_device_name(),
    }
    backend.cleanup()
    row["nodes_check"] = _nodes_check()
    row["seconds"] = time.perf_counter() - start
    return row


def _child(conn: Any, args: tuple[str, str, str, int, str, str]) -> None:
    try:
        conn.send({"ok": True, "row": run_case(*args)})
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        conn.send({"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]})
    finally:
        conn.close()


def _forked(args: tuple[str, str, str, int, str, str], timeout: float) -> dict[str, Any]:
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, args))
    proc.start()
    child.close()
    got: dict[str, Any] = {"ok": False, "error": f"no answer within {timeout:.0f} s"}
    if parent.poll(timeout):
        try:
            got = parent.recv()
        except EOFError:
            got = {"ok": False, "error": "the process died"}
    proc.join(10)
    if proc.is_alive():
        proc.kill()
        proc.join()
    if not got["ok"] and proc.exitcode not in (0, None):
        got["error"] += f" (exit code {proc.exitcode})"
    return got


def _spawned(args: tuple[str, str, str, int, str, str], timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", *args[:3], str(args[3]), *args[4:]]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"no answer within {timeout:.0f} s"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode or not lines:
        return {"ok": False, "error": f"exit code {proc.returncode}", "traceback": proc.stderr[-4000:]}
    return json.loads(lines[-1])  # type: ignore[no-any-return]


def _line(row: dict[str, Any]) -> str:
    d = row.get("driver") or {}
    err = row["forecast_error"]
    nodes = f"{d.get('nodes', 0):,} nodes" if d.get("nodes_counted") else "nodes not counted"
    return (f"{row['model']:9} {row['backend']:9} {row['mode']:8} lost {row['lost_bytes'] / MIB:8.1f} MiB  "
            f"forecast {row['forecast_bytes'] / MIB:8.1f} MiB ({'-' if err is None else f'{err * 100:+.1f}'} %) = "
            f"allocator {row['allocator_bytes'] / MIB:.1f} + driver {row['driver_bytes'] / MIB:.1f} "
            f"({d.get('graphs', 0):,} graphs, {nodes}, first capture {d.get('first_capture')}); session drop "
            f"{(row['session_drop_bytes'] or 0) / MIB:.1f}, allocator error "
            f"{(row['allocator_error'] or 0) * 100:+.1f} %; probes lost {row['probe_driver_bytes'] / MIB:.1f} beyond "
            f"the allocator; eager forward {row['eager_lost_bytes'] / MIB:.1f}; node check "
            f"{'ok' if row['nodes_check']['ok'] else row['nodes_check']}; {row['seconds']:.1f} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("SGLANG_BCG_GPU_RESULTS_DIR") or "out")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--budget-s", type=float, default=200.0, help="start no process after this many seconds")
    ap.add_argument("--spawn", action="store_true", help="a new interpreter per process (default: fork)")
    ap.add_argument("--schedule", default="prefill", choices=("prefill", "pow2", "decode"),
                    help="the sizes: SGLang's prefill list, powers of two, or SGLang's decode batch sizes")
    ap.add_argument("--pool-reserve", default="off", choices=("off", "auto"),
                    help="BackendOptions(pool_reserve=...): auto starts the graph pool as one block")
    ap.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        model, backend, mode, max_tokens, schedule, reserve = args.child
        try:
            print(json.dumps({"ok": True, "row": run_case(model, backend, mode, int(max_tokens), schedule, reserve)}))
        except BaseException as exc:  # noqa: BLE001
            print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}))
        return 0
    start = time.perf_counter()
    import torch  # imported once here (forked children inherit it), CUDA left untouched

    import sglang_bcg_plugin.bench.workload  # noqa: F401 - the bench's models, for the forked children
    models = [m for m in args.models.split(",") if m]
    if "llama" in models:
        try:
            import transformers  # noqa: F401
        except ImportError:
            print("llama: skipped (transformers is not installed)", flush=True)
            models.remove("llama")
    assert not torch.cuda.is_initialized()
    cases = [(m, b, mode, args.max_tokens, args.schedule, args.pool_reserve) for mode in args.modes.split(",") for m in models
             for b in args.backends.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"rows": [], "failed": [], "skipped": []}
    run = _spawned if args.spawn else _forked
    for case in cases:
        name = "/".join(case[:3])
        elapsed = time.perf_counter() - start
        if elapsed > args.budget_s:
            results["skipped"].append(name)
            print(f"{name}: skipped ({elapsed:.0f} s past, budget {args.budget_s:.0f} s)", flush=True)
            continue
        got = run(case, 120.0)
        if not got["ok"] and not args.spawn and "fork" in str(got.get("error", "")) + str(got.get("traceback", "")):
            got = _spawned(case, 120.0)  # CUDA refused the forked process: a new interpreter
        if got["ok"]:
            results["rows"].append(got["row"])
            print(_line(got["row"]), flush=True)
        else:
            results["failed"].append({"case": name, **got})
            print(f"{name}: failed: {got['error']}\n{got.get('traceback', '')}", flush=True)
        results["seconds"] = time.perf_counter() - start
        (out / "forecast_driver.json").write_text(json.dumps(results, indent=1) + "\n")
    results["seconds"] = time.perf_counter() - start
    (out / "forecast_driver.json").write_text(json.dumps(results, indent=1) + "\n")
    errors = [abs(r["forecast_error"]) for r in results["rows"] if r["forecast_error"] is not None]
    print(f"{len(results['rows'])} processes, {len(results['failed'])} failed, {len(results['skipped'])} skipped; "
          f"largest |forecast error| against the free memory lost {max(errors, default=0) * 100:.1f} %; "
          f"{time.perf_counter() - start:.0f} s; {out / 'forecast_driver.json'}", flush=True)
    return 1 if results["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
