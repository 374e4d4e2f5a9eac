"""The reference row: ``torch.compile(mode="reduce-overhead", dynamic=True)`` (CUDA Graph Trees),
measured like our rows (docs/getting-started.md); on CPU the same compile without ``mode``."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from ..shape_key import ShapeKey
from ..trees import flatten
from .progress import progress as progress_bar
from .clock import CompileClock
from .rows import BenchRow
from .runner import _free_bytes, _sync, _time_replay, max_abs_error
from .workload import Workload

GRAPH_TREES = "graph-trees"
REFERENCE_VARIANT = "reference"
#: Backends the "inductor" variant applies to (breakable has no compiled callable to capture).
INDUCTOR_BACKENDS = ("piecewise", "full")


def variants_for(backend: str, variants: list[str]) -> list[str]:
    """The variants the bench runs for ``backend``: the reference once, "inductor" only where
    it means something."""
    if backend == GRAPH_TREES:
        return [REFERENCE_VARIANT]
    return [v for v in variants if runs(backend, v)]


def runs(backend: str, variant: str) -> bool:
    """Whether the bench runs ``variant`` for ``backend`` (``inductor`` variants need a compiled
    callable; ``graph-trees`` ignores ``--variants``)."""
    return not variant.startswith("inductor") or backend in INDUCTOR_BACKENDS


def compile_reference(model: Callable[..., Any], device: str) -> CompileClock:
    """``torch.compile(model, mode="reduce-overhead", dynamic=True)`` (no ``mode`` off CUDA)."""
    if device.startswith("cuda"):
        return CompileClock(torch.compile(model, mode="reduce-overhead", dynamic=True), device)
    return CompileClock(torch.compile(model, dynamic=True), device)


def graph_trees_row(
    workload: Workload, sizes: list[int], *, repeats: int, num_warmups: int = 2, progress: bool = True
) -> BenchRow:
    """Capture every size with Graph Trees; measure like :func:`~.runner.run_variant`."""
    torch._dynamo.reset()  # a fresh compile, as for every variant
    device = workload.shape.device
    gpu = device.startswith("cuda")
    max_tokens = max(sizes)
    model = workload.model_for("full", max_tokens)  # attention inside the compiled graph
    static = workload.static_input(max_tokens)
    compiled = compile_reference(model, device)

    def step(size: int) -> Any:
        if gpu:
            torch.compiler.cudagraph_mark_step_begin()
        return workload.call(compiled, static, size)

    keys = [ShapeKey(s) for s in sorted(sizes, reverse=True)]
    if gpu:
        # Graph Trees clear cuBLAS's workspaces before recording; cleared here first, the ones
        # earlier rows left are not credited to this row, and the ones it makes are charged.
        torch._C._cuda_clearCublasWorkspaces()
    free_before = _free_bytes(device)
    logical = 0
    start = time.perf_counter()
    with torch.no_grad():
        bar = progress_bar(len(keys), f"{GRAPH_TREES}/{REFERENCE_VARIANT}", progress)
        try:
            for key in keys:
                for _ in range(1 + num_warmups):
                    out = step(key.size)
                logical += sum(t.numel() * t.element_size() for _, t in flatten(out)[1])
                del out
                bar.update(1)
        finally:
            bar.close()  # a clean stderr line for an error or Ctrl-C
    _sync(device)
    compile_s = compiled.seconds
    capture_s = time.perf_counter() - start - compile_s
    free_after = _free_bytes(device)
    graph_bytes = None if free_before is None or free_after is None else free_before - free_after

    with torch.no_grad():
        workload.refill(static)
        max_err = 0.0
        for key in keys:
            out = step(key.size)
            max_err = max(max_err, max_abs_error(out, workload.call(model, static, key.size)))
            del out
        replay_ms, replay_min, replay_max = _time_replay(lambda: step(max_tokens), device, repeats)
    del compiled, model
    torch._dynamo.reset()  # drops the compiled code; then the Graph Trees and their pool
    if gpu:
        torch._inductor.cudagraph_trees.reset_cudagraph_trees()
    _free_bytes(device)
    return BenchRow(
        backend=GRAPH_TREES,
        variant=REFERENCE_VARIANT,
        share_output=False,
        num_sizes=len(sizes),
        max_tokens=max_tokens,
        resident_output_bytes=0,
        logical_output_bytes=logical,
        graph_memory_bytes=graph_bytes,
        capture_s=capture_s,
        replay_ms=replay_ms,
        max_abs_err=max_err,
        fallbacks=0,
        model=workload.name,
        replay_ms_min=replay_min,
        replay_ms_max=replay_max,
        compile_s=compile_s,
    )
