"""Measure each backend x variant on a workload, and the reference row, torch's CUDA Graph Trees,
alike (docs/getting-started.md)."""

from __future__ import annotations

import contextlib
import logging
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, NamedTuple, TextIO

import torch

from ..accounting import device_free_bytes
from ..errors import ForecastError
from ..output.guard import guard_supported
from ..options import BackendOptions
from ..output.mode import OutputMode, mode_of_option, parse_mode
from ..registry import create_backend
from ..output.report import MemoryReport
from ..shape_key import ShapeKey
from ..output.trees import flatten
from .sizes import prefill_capture_sizes
from .workload import Workload

log = logging.getLogger(__name__)

GRAPH_TREES = "graph-trees"
REFERENCE_VARIANT = "reference"


class Variant(NamedTuple):
    """How one bench variant captures (``options``: its ``BackendOptions`` but the engine), its
    ``--help`` line and its legend label in ``bench.png``."""

    share: bool | Literal["released"]
    meaning: str
    label: str
    color: str
    keep: bool
    inductor: bool
    options: dict[str, Any]


def _variant(name: str, meaning: str, label: str, color: str) -> Variant:
    """The variant ``name``, its options read off the name: ``off`` and ``floor`` (nothing kept) share
    nothing, ``*released`` releases, ``guard``, ``adopt``/``reserve`` (the buffer source), ``inductor*``,
    ``*packed*`` (``pool_reserve="auto"``), ``*expandable*`` (``pool_segments="expandable"``)."""
    share: bool | Literal["released"] = "released" if name.endswith("released") else name not in ("off", "floor")
    options = {"output_mode": mode_of_option(share), "stale_output_guard": name == "guard",
               "shared_buffer": name if name in ("adopt", "reserve") else "auto",
               "pool_reserve": "auto" if "packed" in name else "off",
               "pool_segments": "expandable" if "expandable" in name else "fixed"}
    return Variant(share, meaning, label, color, name != "floor", name.startswith("inductor"), options)


_ON, _RELEASED, _BLOCK = "sharing on", "outputs released", "pool as one block"
_EXPANDABLE, _GROWN = "pool as one expandable segment", "the pool grown as one expandable segment"
_SIZED = "the pool started as one block the forecast sized (CUDA)"
_COMPILED = "the model compiled by Inductor first (piecewise and full only)"
#: Every variant; docs/getting-started.md lists the same meanings (tests/test_cli.py checks it).
VARIANTS = {name: _variant(name, *about) for name, about in {
    "off": ("sharing off: every size keeps its own output", "sharing off", "#c0504d"),
    "on": ("sharing on: one output buffer per stream, shared by every size", _ON, "#4f81bd"),
    "floor": ("every output released inside its graph: the memory floor (no output to check)",
              f"{_RELEASED} (floor)", "#9bbb59"),
    "guard": ("sharing on, with the stale-output guard", f"{_ON} + stale-output guard", "#8064a2"),
    "adopt": ("sharing on, the first capture's own output adopted as the buffer", f"{_ON}, buffer adopted", "#95b3d7"),
    "reserve": ("sharing on, the buffer reserved before the first capture", f"{_ON}, buffer reserved", "#1f497d"),
    "released": ("zero-copy outputs left in graph-pool memory, valid until the next replay",
                 f"{_RELEASED} (zero-copy)", "#77933c"),
    "inductor": (f"sharing on, {_COMPILED}", f"{_ON}, Inductor-compiled", "#f79646"),
    "inductor-released": (f"zero-copy outputs (released), {_COMPILED}", f"{_RELEASED}, Inductor-compiled", "#e46c0a"),
    "packed": ("sharing on, the graph pool started as one block the forecast sized (pool_reserve='auto', CUDA)",
               f"{_ON}, {_BLOCK}", "#2c4d75"),
    "packed-released": (f"zero-copy outputs (released), {_SIZED}", f"{_RELEASED}, {_BLOCK}", "#4f6228"),
    "inductor-packed": (f"sharing on, Inductor first, {_SIZED}", f"{_ON}, Inductor, {_BLOCK}", "#984807"),
    "inductor-packed-released": (f"released outputs, Inductor first, {_SIZED}", f"{_RELEASED}, Inductor, {_BLOCK}",
                                 "#632523"),
    "expandable-released": (f"released outputs, {_GROWN} while capturing (pool_segments, CUDA)",
                            f"{_RELEASED}, {_EXPANDABLE}", "#b3a2c7"),
    "inductor-expandable": (f"sharing on, Inductor first, {_GROWN} (CUDA)", f"{_ON}, Inductor, {_EXPANDABLE}",
                            "#fac090"),
    "inductor-expandable-released": (f"released outputs, Inductor first, {_GROWN} (CUDA)",
                                     f"{_RELEASED}, Inductor, {_EXPANDABLE}", "#7f6084"),
}.items()}

#: What a variant's word needs a CUDA graph pool for (the eager engine has none).
_POOL_WORDS = {"packed": "pool_reserve='auto' starts a CUDA graph pool as one block",
               "expandable": "pool_segments='expandable' grows a CUDA graph pool",
               "released": "released outputs are aliases of CUDA graph-pool memory"}


def eager_stand_in(variant: str) -> tuple[str, str] | None:
    """What ``variant`` runs as on the eager engine (CPU: no graph pool) and why, when that is not
    ``variant`` itself; else ``None``. The first: a variant's name, or its meaning where none has it."""
    pool = [_POOL_WORDS[w] for w in variant.split("-") if w in _POOL_WORDS]
    guard = variant == "guard" and not guard_supported()
    if not pool and not guard:
        return None
    why = [f"CUDA-only: {'; '.join(pool)}, and the eager engine has no graph pool"] if pool else []
    if guard:
        why.append("the stale-output guard poisons storages, which this torch build cannot; a CUDA build can")
    v = VARIANTS[variant]
    mode = "off" if v.share == "released" else v.options["output_mode"]
    effective = {**v.options, "output_mode": mode, "stale_output_guard": v.options["stale_output_guard"] and not guard,
                 "pool_reserve": "off", "pool_segments": "fixed"}
    same = [n for n, o in VARIANTS.items() if (o.options, o.inductor, o.keep) == (effective, v.inductor, v.keep)]
    ran = same[0] if same else f"'sharing {mode}{', Inductor first' if v.inductor else ''}'"
    return ran, "; ".join(why)


def eager_note(variant: str) -> str | None:
    """The ``note:`` line of a variant that runs as another on the eager engine (:func:`eager_stand_in`)."""
    if (stand_in := eager_stand_in(variant)) is None:
        return None
    return (f"note: --variants {variant} runs as {stand_in[0]} here ({stand_in[1]}): its rows measure that, "
            f"under the name {variant}")


def runs(backend: str, variant: str) -> bool:
    """Whether the bench runs ``variant`` for ``backend`` (``inductor*`` needs a compiled callable)."""
    return not variant.startswith("inductor") or backend in ("piecewise", "full")


def variants_for(backend: str, variants: list[str]) -> list[str]:
    """The variants the bench runs for ``backend``: the reference once for Graph Trees."""
    return [REFERENCE_VARIANT] if backend == GRAPH_TREES else [v for v in variants if runs(backend, v)]


@dataclass
class BenchRow:
    """One backend x variant with its per-size rows: what the table, ``bench.json`` and ``bench.png`` show."""

    backend: str
    variant: str
    output_mode: OutputMode  # "off", "on" or "released", as BackendOptions(output_mode=...)
    num_sizes: int
    max_tokens: int
    resident_output_bytes: int
    logical_output_bytes: int
    graph_memory_bytes: int | None
    capture_s: float
    replay_ms: float
    max_abs_err: float | None
    fallbacks: int
    bridge_bytes: int = 0
    model: str = "synthetic"
    #: fastest and slowest of the timed replays (the spread of ``replay_ms``, the median).
    replay_ms_min: float = 0.0
    replay_ms_max: float = 0.0
    #: one dict per captured key, largest first (:func:`per_size_rows`)
    per_size: list[dict[str, Any]] = field(default_factory=list)
    #: seconds of the calls that compiled, not in ``capture_s``; ``None``: nothing compiled
    compile_s: float | None = None
    #: the forecast before the capture (CUDA; docs/getting-started.md), else ``None``
    forecast_bytes: int | None = None
    forecast_error: float | None = None
    forecast_s: float | None = None
    forecast: dict[str, Any] | None = None
    forecast_driver_bytes: int | None = None
    #: on the eager engine, what a CUDA-only variant ran as instead (:func:`eager_stand_in`), else ``None``
    ran_as: str | None = None
    #: why it ran as ``ran_as``
    ran_as_reason: str | None = None

    to_dict = asdict

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchRow:
        """A row of a ``bench.json``, also one written before ``output_mode`` had its name: its
        ``share_output`` (``True``/``False``/``"released"``, or their ``str()``) is read as the mode."""
        row = dict(data)
        old = row.pop("share_output", None)
        if "output_mode" not in row and old is not None:  # str(): a GPU driver wrote "True" / "False"
            row["output_mode"] = mode_of_option({"True": True, "False": False}.get(old, old) if isinstance(old, str)
                                                else old)
        if row.get("output_mode") is not None:
            row["output_mode"] = parse_mode(row["output_mode"], "bench.json output_mode")
        return cls(**row)


def per_size_rows(report: MemoryReport, compile_s: dict[Any, float] | None = None) -> list[dict[str, Any]]:
    """``bench.json``'s per-size rows from ``memory_report().keys``; ``compile_s`` per key is taken
    out of its ``capture_s``."""
    spent = compile_s or {}
    return [
        {"size": getattr(k.key, "size", None), "stream_idx": getattr(k.key, "stream_idx", None),
         "logical_output_bytes": k.logical_output_bytes, "resident_output_bytes": k.resident_output_bytes,
         "shared": k.shared, "fallback": k.fallback,
         "capture_s": None if k.capture_seconds is None else k.capture_seconds - spent.get(k.key, 0.0),
         "compile_s": spent.get(k.key) if compile_s is not None else None,
         "graph_memory_bytes": k.graph_memory_bytes, "num_segments": k.num_segments}
        for k in report.keys
    ]


class CompileClock:
    """A ``torch.compile``-d callable summing the wall time of the calls that compiled (``compile_s``)."""

    def __init__(self, fn: Callable[..., Any], device: str) -> None:
        self.fn, self.device, self.seconds = fn, device, 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from torch._dynamo.utils import counters

        graphs, start = counters["stats"]["unique_graphs"], time.perf_counter()
        out = self.fn(*args, **kwargs)
        if counters["stats"]["unique_graphs"] != graphs:
            _sync(self.device)
            self.seconds += time.perf_counter() - start
        return out


class LineProgress:
    """tqdm's ``update``/``close`` subset, written as one rewritten stderr line (without tqdm)."""

    def __init__(self, total: int, desc: str, stream: TextIO, enabled: bool) -> None:
        self.total, self.desc, self.stream, self.enabled, self.n = total, desc, stream, enabled, 0

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.enabled:
            print(f"\r{self.desc}: {self.n}/{self.total} sizes", end="", file=self.stream, flush=True)

    def close(self) -> None:
        if self.enabled and self.n:
            blank = " " * (len(self.desc) + 2 * len(str(self.total)) + 10)
            print(f"\r{blank}\r", end="", file=self.stream, flush=True)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _free_bytes(device: str) -> int | None:
    return device_free_bytes() if device.startswith("cuda") else None


def max_abs_error(out: Any, ref: Any) -> float:
    """Largest absolute difference over every tensor leaf of two output trees."""
    (_, a), (_, b) = flatten(out), flatten(ref)
    if len(a) != len(b):
        raise RuntimeError(f"replay returned {len(a)} tensors, the eager forward {len(b)}")
    return max((float((x.float() - y.float()).abs().max()) for (_, x), (_, y) in zip(a, b, strict=True) if x.numel()),
               default=0.0)


def _capture_all(device: str, sizes: list[int], label: str, progress: bool,
                 session: contextlib.AbstractContextManager[Any],
                 capture: Callable[[int], None]) -> tuple[float, int | None]:
    """``capture(size)`` for every size, largest first, inside ``session``, under a progress bar (tqdm
    when installed): the seconds it took and the device memory it kept (``None`` off CUDA)."""
    free_before, start = _free_bytes(device), time.perf_counter()
    with torch.no_grad(), session:
        try:
            from tqdm import tqdm
        except ImportError:  # without the [bench] extra
            bar: Any = LineProgress(len(sizes), label, sys.stderr, progress)
        else:
            bar = tqdm(total=len(sizes), desc=label, unit="size", file=sys.stderr, disable=not progress, leave=False)
        try:
            for size in sorted(sizes, reverse=True):
                capture(size)
                bar.update(1)
        finally:
            bar.close()  # a clean stderr line for an error or Ctrl-C
    _sync(device)
    return time.perf_counter() - start, None if free_before is None else free_before - device_free_bytes()


def _fresh(workload: Workload, model_backend: str, sizes: list[int]) -> tuple[Callable[..., Any], Any]:
    """A fresh dynamo (its recompile limit would count earlier rows' entries) and, on CUDA, no cuBLAS
    workspace left by earlier rows; then ``model_backend``'s model and the static input."""
    torch._dynamo.reset()
    if workload.shape.device.startswith("cuda"):
        torch._C._cuda_clearCublasWorkspaces()
    return workload.model_for(model_backend, max(sizes)), workload.static_input(max(sizes))


def _replay_all(workload: Workload, sizes: list[int], static: Any, replay: Callable[[int], Any],
                model: Callable[..., Any] | None, repeats: int) -> dict[str, Any]:
    """The row's replay fields: after new inputs, every size's largest error against the eager
    ``model`` (``None``: not checked), and the median, min and max milliseconds of ``repeats``
    replays of the largest size (CUDA events on GPU, perf_counter on CPU)."""
    device = workload.shape.device
    with torch.no_grad():
        workload.refill(static)  # inputs change after capture
        max_err = None if model is None else max([0.0, *(
            max_abs_error(replay(s), workload.call(model, static, s)) for s in sorted(sizes, reverse=True))])
        for _ in range(3):
            replay(max(sizes))
        _sync(device)
        times = []
        for _ in range(repeats):
            if device.startswith("cuda"):
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                replay(max(sizes))
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                replay(max(sizes))
                times.append((time.perf_counter() - t0) * 1e3)
    return {"max_abs_err": max_err, "replay_ms": statistics.median(times),
            "replay_ms_min": min(times), "replay_ms_max": max(times)}


def run_variant(backend_name: str, variant: str, workload: Workload, sizes: list[int], *, repeats: int,
                progress: bool = True, forecast: bool = True,
                after_capture: Callable[[ShapeKey], None] | None = None) -> BenchRow:
    """Capture every size with one backend and variant; measure memory, time and error (on CUDA,
    after a forecast of the schedule). ``after_capture(key)`` runs after each size's capture."""
    v = VARIANTS[variant]
    device = workload.shape.device
    model, static = _fresh(workload, backend_name, sizes)
    options = BackendOptions(engine="cuda" if device.startswith("cuda") else "eager", **v.options)
    piecewise: dict[str, Any] = {"splitting_ops": list(workload.splitting_ops), "inductor": v.inductor}
    backend = create_backend(backend_name, options=options, **(piecewise if backend_name == "piecewise" else {}))
    fn = backend.compile(model, dynamic_dim=workload.dynamic_dim)
    if v.inductor and backend_name != "piecewise":  # Inductor, no cudagraphs: the backend captures it
        fn = CompileClock(torch.compile(model, dynamic=True), device)

    def forward_for(s: int) -> Callable[[], Any]:
        return (lambda: workload.call(fn, static, s)) if v.keep else lambda: (workload.call(fn, static, s), None)[1]

    def compiled_s() -> float | None:  # None: nothing is compiled
        return getattr(backend, "compile_seconds", fn.seconds if isinstance(fn, CompileClock) else None)

    predicted, forecast_compile = (_forecast(backend, sizes, forward_for, static, compiled_s) if forecast
                                   else (None, 0.0))
    per_key_compile: dict[Any, float] = {}

    def capture(size: int) -> None:
        key, before = ShapeKey(size), compiled_s()
        backend.capture_one(key, forward_for(size), capture_inputs=static, post_warmup_hook=workload.post_warmup_hook)
        if before is not None:
            per_key_compile[key] = compiled_s() - before  # type: ignore[operator]
        if after_capture is not None:
            after_capture(key)

    elapsed, graph_bytes = _capture_all(device, sizes, f"{backend_name}/{variant}", progress, backend.capture_session(),
                                        capture)
    compile_s = compiled_s()
    report = backend.memory_report()
    replayed = _replay_all(workload, sizes, static, lambda s: backend.replay(ShapeKey(s)), model if v.keep else None,
                           repeats)
    backend.cleanup()  # the graphs, pools and buffers go; the next variant measures from here
    ran_as, why = (None if device.startswith("cuda") else eager_stand_in(variant)) or (None, None)  # engine: device
    row = BenchRow(backend=backend_name, variant=variant, output_mode=v.options["output_mode"], num_sizes=len(sizes),
                   max_tokens=max(sizes), resident_output_bytes=report.resident_output_bytes,
                   logical_output_bytes=report.logical_output_bytes, graph_memory_bytes=graph_bytes,
                   capture_s=elapsed - ((compile_s or 0.0) - forecast_compile), fallbacks=len(report.fallbacks),
                   bridge_bytes=report.total_bridge_bytes, model=workload.name,
                   per_size=per_size_rows(report, per_key_compile if compile_s is not None else None),
                   compile_s=compile_s, ran_as=ran_as, ran_as_reason=why, **replayed,
                   **_forecast_fields(predicted, graph_bytes, forecast_compile))
    log.info("%s", row)
    return row


def _forecast(backend: Any, sizes: list[int], forward_for: Callable[[int], Callable[[], Any]], static: Any,
              compiled_s: Callable[[], float | None]) -> tuple[Any, float]:
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


def graph_trees_row(workload: Workload, sizes: list[int], *, repeats: int, num_warmups: int = 2,
                    progress: bool = True) -> BenchRow:
    """Capture every size with Graph Trees; measure like :func:`run_variant`."""
    device = workload.shape.device
    gpu = device.startswith("cuda")
    model, static = _fresh(workload, "full", sizes)  # attention inside the compiled graph
    # the one reference to the compiled callable, emptied before torch's reset below (a closure
    # cannot use a name deleted in its function)
    compiled = {"fn": CompileClock(torch.compile(model, mode="reduce-overhead" if gpu else None, dynamic=True), device)}
    logical = [0]

    def step(size: int) -> Any:
        if gpu:
            torch.compiler.cudagraph_mark_step_begin()
        return workload.call(compiled["fn"], static, size)

    def capture(size: int) -> None:
        out = None
        for _ in range(1 + num_warmups):
            out = step(size)  # the previous step's output is alive meanwhile, as in a serving loop
        logical[0] += sum(t.nbytes for _, t in flatten(out)[1])

    elapsed, graph_bytes = _capture_all(device, sizes, f"{GRAPH_TREES}/{REFERENCE_VARIANT}", progress,
                                        contextlib.nullcontext(), capture)
    compile_s = compiled["fn"].seconds
    replayed = _replay_all(workload, sizes, static, step, model, repeats)
    compiled.clear()
    del model
    torch._dynamo.reset()  # drops the compiled code; then the Graph Trees and their pool
    if gpu:
        torch._inductor.cudagraph_trees.reset_cudagraph_trees()
    _free_bytes(device)
    return BenchRow(backend=GRAPH_TREES, variant=REFERENCE_VARIANT, output_mode="off", num_sizes=len(sizes),
                    max_tokens=max(sizes), resident_output_bytes=0, logical_output_bytes=logical[0],
                    graph_memory_bytes=graph_bytes, capture_s=elapsed - compile_s, fallbacks=0, model=workload.name,
                    compile_s=compile_s, **replayed)


def warm_up(workload: Workload, backends: list[str], sizes: list[int] | None = None) -> BenchRow | None:
    """On CUDA with ``sizes``, the whole schedule once per backend (released), the first after its
    forecast and returned (the cold row, :func:`cold_summary`; ``None`` elsewhere); then one capture
    cycle per backend at the smallest size."""
    rows = [run_variant(name, "released", workload, sizes, repeats=1, progress=False, forecast=i == 0)
            for i, name in enumerate(backends) if sizes and workload.shape.device.startswith("cuda")]
    for name in backends:
        run_variant(name, "off", workload, prefill_capture_sizes(4), repeats=1, progress=False, forecast=False)
    return rows[0] if rows else None


def cold_summary(row: BenchRow | None) -> dict[str, Any] | None:
    """What the cold row's process lost in free device memory over forecast and capture (its first
    schedule) against the forecast with the driver's share; ``None`` without a forecast."""
    if row is None or not row.forecast or row.graph_memory_bytes is None:
        return None
    lost = row.graph_memory_bytes + int(row.forecast.get("lasting_bytes", 0))
    forecast = int(row.forecast["modes"][row.forecast["mode"]]["total_bytes"])
    return {"backend": row.backend, "variant": row.variant, "num_sizes": row.num_sizes, "lost_bytes": lost,
            "forecast_bytes": forecast, "forecast_error": (forecast - lost) / lost if lost else None}
