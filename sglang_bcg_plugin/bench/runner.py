"""Measure each backend x variant on a workload (synthetic decoder or transformers' Llama)."""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..accounting import device_free_bytes
from ..errors import ForecastError
from ..options import BackendOptions
from ..output_mode import mode_of_option
from ..registry import create_backend
from ..shape_key import ShapeKey
from ..trees import flatten
from .clock import CompileClock
from .progress import progress as progress_bar
from .rows import BenchRow, per_size_rows
from .sizes import prefill_capture_sizes
from .workload import Workload

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Variant:
    """How one bench variant captures: sharing, kept outputs, guard, buffer source, Inductor first,
    and the pool options."""

    share: bool | Literal["released"]
    keep: bool = True
    guard: bool = False
    shared_buffer: str = "auto"
    inductor: bool = False
    pool_reserve: str = "off"
    pool_segments: str = "fixed"


#: What each variant means: :data:`VARIANT_MEANINGS`.
VARIANTS = {
    "off": Variant(False),
    "on": Variant(True),
    "floor": Variant(False, keep=False),
    "guard": Variant(True, guard=True),
    "adopt": Variant(True, shared_buffer="adopt"),
    "reserve": Variant(True, shared_buffer="reserve"),
    "released": Variant("released"),
    "inductor": Variant(True, inductor=True),
    "inductor-released": Variant("released", inductor=True),
    "packed": Variant(True, pool_reserve="auto"),
    "packed-released": Variant("released", pool_reserve="auto"),
    "inductor-packed": Variant(True, inductor=True, pool_reserve="auto"),
    "inductor-packed-released": Variant("released", inductor=True, pool_reserve="auto"),
    "expandable-released": Variant("released", pool_segments="expandable"),
    "inductor-expandable": Variant(True, inductor=True, pool_segments="expandable"),
    "inductor-expandable-released": Variant("released", inductor=True, pool_segments="expandable"),
}
#: One line per variant: ``sglang-bcg bench --help`` prints them and docs/getting-started.md
#: lists the same words (tests/test_cli.py checks both).
VARIANT_MEANINGS = {
    "off": "sharing off: every size keeps its own output",
    "on": "sharing on: one output buffer per stream, shared by every size",
    "floor": "every output released inside its graph: the memory floor (no output to check)",
    "guard": "sharing on, with the stale-output guard",
    "adopt": "sharing on, the first capture's own output adopted as the buffer",
    "reserve": "sharing on, the buffer reserved before the first capture",
    "released": "zero-copy outputs left in graph-pool memory, valid until the next replay",
    "inductor": "sharing on, the model compiled by Inductor first (piecewise and full only)",
    "inductor-released": "zero-copy outputs (released), the model compiled by Inductor first (piecewise and full only)",
    "packed": "sharing on, the graph pool started as one block the forecast sized (pool_reserve='auto', CUDA)",
    "packed-released": "zero-copy outputs (released), the pool started as one block the forecast sized (CUDA)",
    "inductor-packed": "sharing on, Inductor first, the pool started as one block the forecast sized (CUDA)",
    "inductor-packed-released": "released outputs, Inductor first, the pool started as one block the forecast sized (CUDA)",
    "expandable-released": "released outputs, the pool grown as one expandable segment while capturing (pool_segments, CUDA)",
    "inductor-expandable": "sharing on, Inductor first, the pool grown as one expandable segment (CUDA)",
    "inductor-expandable-released": "released outputs, Inductor first, the pool grown as one expandable segment (CUDA)",
}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _free_bytes(device: str) -> int | None:
    return device_free_bytes() if device.startswith("cuda") else None


def _time_replay(replay: Callable[[], Any], device: str, repeats: int) -> tuple[float, float, float]:
    """Median, min and max milliseconds of ``repeats`` replays (CUDA events on GPU,
    perf_counter on CPU)."""
    for _ in range(3):
        replay()
    _sync(device)
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            replay()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), min(times), max(times)


def max_abs_error(out: Any, ref: Any) -> float:
    """Largest absolute difference over every tensor leaf of two output trees."""
    (_, a), (_, b) = flatten(out), flatten(ref)
    if len(a) != len(b):
        msg = f"replay returned {len(a)} tensors, the eager forward {len(b)}"
        raise RuntimeError(msg)
    return max((float((x.float() - y.float()).abs().max()) for (_, x), (_, y) in zip(a, b, strict=True) if x.numel()), default=0.0)


def run_variant(
    backend_name: str,
    variant: str,
    workload: Workload,
    sizes: list[int],
    *,
    repeats: int,
    progress: bool = True,
    forecast: bool = True,
    after_capture: Callable[[ShapeKey], None] | None = None,
) -> BenchRow:
    """Capture every size with one backend and variant; measure memory, time and error (on CUDA,
    after a forecast of the schedule). ``after_capture(key)`` runs after each size's capture."""
    # Every variant compiles afresh, and dynamo's recompile limit (8 entries per code object,
    # whatever the backend) would otherwise count the entries of every earlier variant.
    torch._dynamo.reset()
    v = VARIANTS[variant]
    device = workload.shape.device
    if device.startswith("cuda"):
        # Every row pays its capture streams' cuBLAS workspaces, as the Graph Trees row does:
        # torch hands streams out round-robin from a pool of 32, so without this a row's figure
        # would hold 32 MiB more or less by whether an earlier row had used its stream.
        torch._C._cuda_clearCublasWorkspaces()
    options = BackendOptions(
        output_mode=mode_of_option(v.share),
        engine="cuda" if device.startswith("cuda") else "eager",
        stale_output_guard=v.guard,
        shared_buffer=v.shared_buffer,  # type: ignore[arg-type]
        pool_reserve=v.pool_reserve,  # type: ignore[arg-type]
        pool_segments=v.pool_segments,  # type: ignore[arg-type]
    )
    kwargs: dict[str, Any] = {}
    if backend_name == "piecewise":
        kwargs["splitting_ops"] = list(workload.splitting_ops)
        kwargs["inductor"] = v.inductor
    max_tokens = max(sizes)
    model = workload.model_for(backend_name, max_tokens)
    static = workload.static_input(max_tokens)
    backend = create_backend(backend_name, options=options, **kwargs)
    fn = backend.compile(model, dynamic_dim=workload.dynamic_dim)
    if v.inductor and backend_name != "piecewise":  # Inductor, no cudagraphs: the backend captures it
        fn = CompileClock(torch.compile(model, dynamic=True), device)

    def forward_for(s: int) -> Callable[[], Any]:
        if v.keep:
            return lambda: workload.call(fn, static, s)
        return lambda: (workload.call(fn, static, s), None)[1]

    def compiled_s() -> float | None:
        """Seconds compiling so far (``None``: nothing is compiled)."""
        return getattr(backend, "compile_seconds", fn.seconds if isinstance(fn, CompileClock) else None)

    predicted, forecast_compile = _forecast(backend, sizes, forward_for, static, compiled_s) if forecast else (None, 0.0)
    free_before = _free_bytes(device)
    start = time.perf_counter()
    keys = [ShapeKey(s) for s in sorted(sizes, reverse=True)]
    per_key_compile: dict[Any, float] = {}
    with torch.no_grad(), backend.capture_session():
        bar = progress_bar(len(keys), f"{backend_name}/{variant}", progress)
        try:
            for key in keys:
                before = compiled_s()
                backend.capture_one(
                    key, forward_for(key.size), capture_inputs=static, post_warmup_hook=workload.post_warmup_hook
                )
                if before is not None:
                    per_key_compile[key] = compiled_s() - before  # type: ignore[operator]
                if after_capture is not None:
                    after_capture(key)
                bar.update(1)
        finally:
            bar.close()  # a clean stderr line for an error or Ctrl-C
    _sync(device)
    compile_s = compiled_s()
    capture_s = time.perf_counter() - start - ((compile_s or 0.0) - forecast_compile)
    free_after = _free_bytes(device)
    graph_bytes = None if free_before is None or free_after is None else free_before - free_after
    report = backend.memory_report()

    with torch.no_grad():
        workload.refill(static)  # inputs change after capture
        max_err = 0.0
        if v.keep:
            for key in keys:
                out = backend.replay(key)
                max_err = max(max_err, max_abs_error(out, workload.call(model, static, key.size)))
        largest = keys[0]
        replay_ms, replay_min, replay_max = _time_replay(lambda: backend.replay(largest), device, repeats)
    backend.cleanup()  # the graphs, pools and buffers go; the next variant measures from here
    row = BenchRow(
        backend=backend_name,
        variant=variant,
        share_output=v.share,
        num_sizes=len(sizes),
        max_tokens=max_tokens,
        resident_output_bytes=report.resident_output_bytes,
        logical_output_bytes=report.logical_output_bytes,
        graph_memory_bytes=graph_bytes,
        capture_s=capture_s,
        replay_ms=replay_ms,
        max_abs_err=max_err if v.keep else None,
        fallbacks=len(report.fallbacks),
        bridge_bytes=report.total_bridge_bytes,
        model=workload.name,
        replay_ms_min=replay_min,
        replay_ms_max=replay_max,
        per_size=per_size_rows(report, per_key_compile if compile_s is not None else None),
        compile_s=compile_s,
        **_forecast_fields(predicted, graph_bytes, forecast_compile),
    )
    log.info("%s", row)
    return row


def _forecast(
    backend: Any, sizes: list[int], forward_for: Callable[[int], Callable[[], Any]], static: Any,
    compiled_s: Callable[[], float | None],
) -> tuple[Any, float]:
    """``backend.forecast`` of the schedule on the CUDA engine (``None`` elsewhere, or where the
    forward cannot be forecast: a warning), and the compile seconds it paid."""
    if backend.engine_name != "cuda":
        return None, 0.0
    before = compiled_s() or 0.0
    try:
        result = backend.forecast(sizes, forward_for, capture_inputs=static)
    except ForecastError as exc:
        log.warning("%s: no forecast: %s", backend.name, exc)
        result = None
    return result, (compiled_s() or 0.0) - before


def _forecast_fields(forecast: Any, graph_bytes: int | None, compile_s: float = 0.0) -> dict[str, Any]:
    """The row's forecast fields: ``forecast_s`` without the compile time, the driver's share apart
    (:func:`warm_up` paid it)."""
    if forecast is None:
        return {}
    total = forecast.bytes_for(driver=False)
    error = None if not graph_bytes else (total - graph_bytes) / graph_bytes
    return {"forecast_bytes": total, "forecast_error": error, "forecast_s": forecast.seconds - compile_s,
            "forecast": forecast.to_dict(), "forecast_driver_bytes": forecast.modes[forecast.mode].driver_bytes}


def warm_up(workload: Workload, backends: list[str], sizes: list[int] | None = None) -> None:
    """One capture cycle per backend at the smallest size, and on CUDA with ``sizes`` the whole
    schedule once (released), so lazy allocations and the CUDA driver's share are not charged to
    the first measured variant."""
    for name in backends:
        run_variant(name, "off", workload, prefill_capture_sizes(4), repeats=1, progress=False, forecast=False)
    if sizes and workload.shape.device.startswith("cuda"):
        for name in backends:
            run_variant(name, "released", workload, sizes, repeats=1, progress=False, forecast=False)
