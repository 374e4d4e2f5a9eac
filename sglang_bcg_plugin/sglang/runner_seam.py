"""SGLang 0.5.13: the core's ``CaptureState`` around ``BreakableCudaGraphRunner``'s own capture loop
(docs/sglang.md#sglang-0513-the-runner-seam)."""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from typing import Any

from ..output.state import CaptureState
from ..engines.gcsafe import gc_safe_capture
from ..shape_key import ShapeKey
from .compat import RUNNER_MODULE, SGLANG_BREAKABLE, capture_var, num_segments
from .sglang_session import open_state

#: HookRegistry targets of the two AROUND hooks (SGLang 0.5.13).
CAPTURE_ALL_TARGET = "sglang.srt.model_executor.breakable_cuda_graph_runner.BreakableCudaGraphRunner._capture_all"
CAPTURE_ONE_TARGET = "sglang.srt.model_executor.breakable_cuda_graph_runner.BreakableCudaGraphRunner._capture_one"

#: The attribute our state lives in on the runner.
STATE_ATTR = "_bcg_state"


def runner_state(runner: Any) -> CaptureState:
    """The runner's capture state (created on first use)."""
    return runner.__dict__.setdefault(STATE_ATTR, CaptureState(SGLANG_BREAKABLE, "sglang-bcg-runner"))


def around_capture_all(original_fn: Callable[..., Any], runner: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of ``BreakableCudaGraphRunner._capture_all``: one capture session."""
    state = runner_state(runner)
    open_state(state)
    try:
        with gc_safe_capture():
            return original_fn(runner, *args, **kwargs)
    finally:
        state.close()


def around_capture_one(original_fn: Callable[..., Any], runner: Any, num_tokens: int, pool: Any, stream: Any,
                       *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of ``BreakableCudaGraphRunner._capture_one``: the policy on one size's output."""
    state: CaptureState | None = runner.__dict__.get(STATE_ATTR)
    if state is None or state.mode_active is None:  # called outside _capture_all: SGLang's own
        return original_fn(runner, num_tokens, pool, stream, *args, **kwargs)
    key = ShapeKey(num_tokens)  # prefill tokens, one stream
    state.begin(key)
    var = capture_var(_capture_cls())
    shadowed = runner.__dict__.get("_run_forward")  # an instance's own, restored below
    forward = runner._run_forward
    placed: list[Any] = []

    def run_forward(*fargs: Any, **fkwargs: Any) -> Any:
        out = forward(*fargs, **fkwargs)
        if var.get() is None:  # a warmup: the buffer comes from its output, outside the pool
            state.policy.reserve(key, out)
            return out
        placed.append(state.policy.place(key, out))
        return placed[-1]

    start = time.perf_counter()
    runner._run_forward = run_forward
    try:
        graph, _ = original_fn(runner, num_tokens, pool, stream, *args, **kwargs)
    finally:
        if shadowed is None:
            del runner._run_forward
        else:
            runner._run_forward = shadowed
    if len(placed) != 1:
        raise RuntimeError(f"BreakableCudaGraphRunner._capture_one({num_tokens}) ran the forward {len(placed)} times "
                           "inside its capture; expected once (the runner seam of SGLang 0.5.13)")
    placed.clear()  # released: the policy holds the last reference to the graph's own output
    output = state.commit(key, graph=graph, num_segments=num_segments(graph), seconds=time.perf_counter() - start)
    return graph, output


def _capture_cls() -> type:
    return importlib.import_module(RUNNER_MODULE).BreakableCUDAGraphCapture


def runner_report(runner: Any) -> Any:
    """The memory report of a runner's last capture (``None`` before one)."""
    state: CaptureState | None = runner.__dict__.get(STATE_ATTR)
    return None if state is None else state.report()

