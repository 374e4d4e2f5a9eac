"""Per-session settings of the SGLang-integrated backend, and its pool housekeeping.

Kept apart from :mod:`.sglang_breakable` so the backend class reads as SGLang's capture
sequence plus our policy; everything here is a plain function of SGLang state.

* :func:`open_session` resolves the output mode (flag stash > env > the installed SGLang's
  own default, :mod:`.builtin`), the shared-buffer strategy and the stale-output guard;
* :func:`reserve_from_warmup` allocates a partition's shared buffer from the last warmup output,
  outside the graph pool (``reserve``), honouring the runner's row hooks;
* :func:`drop_global_pool` makes ``cleanup()`` leave SGLang's process-global graph pool in a
  state a new capture session can use (see its docstring).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any

from .._constants import ENV_SHARED_BUFFER, ENV_STALE_OUTPUT_GUARD
from ..guard import StaleOutputGuard, guard_supported
from ..options import parse_bool_env
from ..output_mode import ON, RELEASED, Resolution, explain_output_mode
from ..sharing import BufferSource, OutputSharer
from ..trees import collect_tensors, flatten, storage_key, unflatten
from .builtin import sglang_builtin_policy

#: SGLang's switch for eager tensors borrowing free graph-pool memory between replays.
BORROW_ENV = "SGLANG_ENABLE_GRAPH_POOL_BORROW"


@dataclass(eq=False)
class SessionSettings:
    """What one capture session of the SGLang-integrated backend runs with."""

    resolution: Resolution
    sharer: OutputSharer
    strategy: BufferSource
    guard: StaleOutputGuard | None

    @property
    def released(self) -> bool:
        return self.resolution.mode == RELEASED


def resolve_mode(server_args: object | None, environ: Mapping[str, str] | None = None) -> Resolution:
    """Flag stash > ``SGLANG_ENABLE_BCG_SHARED_OUTPUT`` > the installed SGLang's own default."""
    policy = sglang_builtin_policy()
    return explain_output_mode(
        None, server_args=server_args, environ=environ, default=policy.default_mode, default_reason=policy.default_reason()
    )


def shared_buffer(environ: Mapping[str, str] | None = None) -> BufferSource:
    """Where the shared buffer comes from on SGLang's engine: ``reserve`` (measured best: floor +
    one output on the H200, as SGLang's own separate buffer; adopting the largest output cost
    floor + 1.96 outputs), or ``SGLANG_BCG_SHARED_BUFFER=adopt|reserve``.

    :raises ValueError: the variable holds something else.
    """
    env = os.environ if environ is None else environ
    raw = (env.get(ENV_SHARED_BUFFER) or "").strip().lower()
    if not raw:
        return "reserve"
    if raw in ("adopt", "reserve"):
        return raw  # type: ignore[return-value]
    msg = f"{ENV_SHARED_BUFFER}={env.get(ENV_SHARED_BUFFER)!r} is not a buffer source; use 'adopt' or 'reserve' (or unset it)"
    raise ValueError(msg)


def _check_released_allowed(environ: Mapping[str, str]) -> None:
    if parse_bool_env(BORROW_ENV, environ):
        msg = (
            f"output mode 'released' cannot run with {BORROW_ENV}=1: released outputs live in free "
            "graph-pool memory, which SGLang's graph-pool borrowing hands to eager tensors between "
            "replays (sglang/srt/model_executor/runner_utils/pool.py, borrow_graph_pool); use "
            f"--enable-bcg-shared-output=on or unset {BORROW_ENV}"
        )
        raise ValueError(msg)


def _guard(previous: StaleOutputGuard | None, environ: Mapping[str, str]) -> StaleOutputGuard | None:
    if not parse_bool_env(ENV_STALE_OUTPUT_GUARD, environ):
        return None
    if not guard_supported():
        warnings.warn(
            f"{ENV_STALE_OUTPUT_GUARD} is on but this torch build cannot poison storages "
            "(needs torch._C._set_storage_access_error_msg, present in CUDA builds); the guard does nothing",
            RuntimeWarning,
            stacklevel=5,
        )
        return None
    return previous or StaleOutputGuard()


def open_session(
    server_args: object | None, previous_guard: StaleOutputGuard | None, environ: Mapping[str, str] | None = None
) -> SessionSettings:
    """Resolve everything a capture session fixes (read at every session, so it can change).

    :raises ValueError: a switch holds an invalid value, or ``released`` meets graph-pool
        borrowing.
    """
    env = os.environ if environ is None else environ
    resolution = resolve_mode(server_args, env)
    if resolution.mode == RELEASED:
        _check_released_allowed(env)
    strategy = shared_buffer(env)
    sharer = OutputSharer(enabled=resolution.mode == ON, strict=False, source=strategy)
    return SessionSettings(resolution, sharer, strategy, _guard(previous_guard, env))


def apply_runner_rows(output: Any, rows: object) -> Any:
    """Trim the padded-row leaves of ``output`` to ``rows`` (``cuda_graph_output_rows``).

    The *padded row dim* ``P`` is the largest leading dim among the output's tensor leaves;
    every leaf whose leading dim equals ``P`` is handed out as ``leaf[:rows]`` (only when
    ``rows < P``). Leaves with another leading dim keep all their rows. ``None`` leaves the
    output as the body produced it.
    """
    if rows is None:
        return output
    if isinstance(rows, bool) or not isinstance(rows, int):
        msg = f"cuda_graph_output_rows() returned {rows!r}; expected None or an int >= 0"
        raise TypeError(msg)
    if rows < 0:
        msg = f"cuda_graph_output_rows() returned {rows}; expected None or an int >= 0"
        raise ValueError(msg)
    node, leaves = flatten(output)
    padded = max((t.shape[0] for _, t in leaves if t.dim() > 0), default=None)
    if padded is None or rows >= padded:
        return output
    return unflatten(node, [t[:rows] if t.dim() > 0 and t.shape[0] == padded else t for _, t in leaves])


def reserve_from_warmup(sharer: OutputSharer, key: Hashable, runner: Any, warmup_out: Any) -> None:
    """``reserve``: the partition's buffer from the last warmup's output, outside the pool.

    Rows as the capture will hand them out (``cuda_graph_output_rows``), grown to
    ``cuda_graph_output_capacity_rows`` when the runner asks for more (SGLang's own capacity hook).
    """
    if not sharer.enabled or warmup_out is None:
        return
    trimmed = apply_runner_rows(warmup_out, runner.cuda_graph_output_rows(warmup_out))
    capacity = runner.cuda_graph_output_capacity_rows(warmup_out)
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int)):
        msg = f"cuda_graph_output_capacity_rows() returned {capacity!r}; expected None or an int >= 0"
        raise TypeError(msg)
    try:
        sharer.reserve(key, trimmed, capacity_rows=capacity)
    except TypeError:
        return  # an unsupported tensor holder: the capture's own policy raises the real TypeError


def drop_global_pool(pool: Any) -> bool:
    """After ``cleanup()``: forget SGLang's process-global pool handle when it is ``pool``.

    Why: ``cleanup()`` destroys every graph of the pool, so the caching allocator marks the
    pool freeable (its use count drops to 0) but keeps it until an ``empty_cache()`` finds all
    its blocks free. SGLang's ``get_or_create_global_graph_memory_pool`` would hand the same
    handle to the next capture session, and capturing into a freeable pool fails
    (``it->second->use_count > 0`` INTERNAL ASSERT in ``CUDACachingAllocator.cpp``), as does
    every later capture. SGLang's own recapture path does the same reset
    (``model_runner_components/cuda_graph_setup.py``, ``drop_elastic_cuda_graph_state``), so the
    next session gets a fresh handle and the old pool's memory returns at the next
    ``empty_cache()``. A handle another backend installed since is left alone; backends still
    holding graphs in the old pool keep their own handle (``self._pool``) and keep working.
    """
    from sglang.srt.model_executor.runner_utils import pool as sglang_pool

    if pool is None or sglang_pool.get_global_graph_memory_pool() != pool:
        return False
    sglang_pool.set_global_graph_memory_pool(None)
    return True


def runner_server_args(cuda_graph_runner: object) -> object | None:
    """SGLang's ``ServerArgs`` reachable from a graph runner, else this process's, else ``None``."""
    server_args: object | None = getattr(getattr(cuda_graph_runner, "model_runner", None), "server_args", None)
    if server_args is not None:
        return server_args
    try:
        from sglang.srt.runtime_context import get_server_args

        published: object = get_server_args()
        return published
    except (ImportError, ValueError, AttributeError):  # not published in this process
        return None


def input_storages(capture_inputs: object) -> frozenset[tuple[str, int]]:
    """Storages of static inputs (any object, e.g. a ForwardBatch), never adopted as a buffer."""
    return frozenset(storage_key(t) for t in collect_tensors(capture_inputs))


#: SGLang's "capture in progress" context variable (read by every ``eager_on_graph`` wrapper).
CAPTURE_VAR = (
    "sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph.breakable_cuda_graph"
    "._current_capture_var"
)


def run_outside_capture(forward_fn: Callable[[], Any]) -> Any:
    """Run ``forward_fn`` with SGLang's capture variable unset (its breaks run inline)."""
    import pkgutil

    var = pkgutil.resolve_name(CAPTURE_VAR)
    token = var.set(None)
    try:
        return forward_fn()
    finally:
        var.reset(token)
