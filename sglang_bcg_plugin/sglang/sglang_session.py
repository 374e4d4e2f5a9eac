"""What a capture session inside SGLang reads from it: its switches (:func:`session_switches`, the
one resolution), the runner's row hooks, and SGLang's global graph pool."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .._constants import ENV_SHARE_OUTPUT
from .._words import parse_bool_env, parse_env
from ..output.plan import BufferSource, SessionPlan, plan_session
from ..output.state import CaptureState
from ..output.mode import RELEASED, OutputMode, Resolution, explain_output_mode
from ..output.released import released_supported
from ..output.trees import flatten, unflatten
from . import compat
from .compat import ENV_SHARED_BUFFER, ENV_STALE_OUTPUT_GUARD, Seam, pool_borrowing_exists, sglang_builtin_policy

#: SGLang's switch for eager tensors borrowing free graph-pool memory between replays.
BORROW_ENV = "SGLANG_ENABLE_GRAPH_POOL_BORROW"


def resolve_mode(environ: Mapping[str, str] | None = None) -> Resolution:
    """``SGLANG_ENABLE_BCG_SHARED_OUTPUT`` (set by the flag) > the installed SGLang's own default."""
    policy = sglang_builtin_policy()
    return explain_output_mode(None, environ=environ, default=policy.default_mode,
                               default_reason=policy.default_reason())


def shared_buffer(environ: Mapping[str, str] | None = None) -> BufferSource:
    """``SGLANG_BCG_SHARED_BUFFER=adopt|reserve``; unset or blank: ``reserve``. :raises ValueError: anything else."""
    words: dict[str, BufferSource] = {"adopt": "adopt", "reserve": "reserve"}
    accepted = "'adopt' or 'reserve', or unset it"
    return parse_env(ENV_SHARED_BUFFER, words, kind="a buffer source", accepted=accepted, environ=environ) or "reserve"


def refusal(seam: Seam, mode: OutputMode, guard: bool, environ: Mapping[str, str]) -> str | None:
    """Why the installed release cannot run ``mode`` (with the guard if ``guard``), in one line;
    ``None`` when it can. Checked at startup (the flag hook) and at every capture session."""
    where = f"SGLang {seam.release}"
    if seam.kind == "none":
        return (f"{where} has no breakable CUDA graph this plugin can hook ({seam.why}); output mode "
                f"{mode!r} has nothing to apply to: unset {ENV_SHARE_OUTPUT} / --enable-bcg-shared-output")
    if mode == RELEASED and not released_supported():
        return ("output mode 'released' needs torch._C._construct_storage_from_data_pointer, which this torch lacks; "
                "use on")
    if mode == RELEASED and parse_bool_env(BORROW_ENV, environ) and pool_borrowing_exists():
        return (f"output mode 'released' cannot run with {BORROW_ENV}=1: released outputs live in free "
                "graph-pool memory, which SGLang's graph-pool borrowing hands to eager tensors between "
                "replays (sglang/srt/model_executor/runner_utils/pool.py, borrow_graph_pool); use "
                f"--enable-bcg-shared-output=on or unset {BORROW_ENV}")
    if guard and seam.kind == "runner":
        return (f"{ENV_STALE_OUTPUT_GUARD}=1 needs replays that go through this plugin, and {where}'s "
                "BreakableCudaGraphRunner.replay reads output_buffers itself (the runner seam); "
                f"unset {ENV_STALE_OUTPUT_GUARD}")
    return None


def session_switches(environ: Mapping[str, str]) -> tuple[Resolution, bool]:
    """The output mode (with its reason) and the guard a capture session runs with.
    :raises ValueError: an invalid switch, or the release cannot run it (:func:`refusal`)."""
    resolution = resolve_mode(environ)
    guard = bool(parse_bool_env(ENV_STALE_OUTPUT_GUARD, environ))
    try:
        seam = compat.installed()
    except Exception:  # noqa: BLE001 - SGLang does not fully import here: `sglang-bcg doctor` says why
        return resolution, guard
    reason = refusal(seam, resolution.mode, guard, environ)
    if reason is not None:
        raise ValueError(reason)
    return resolution, guard


def open_state(state: CaptureState, resume: bool = False) -> SessionPlan:
    """Open ``state`` with a plan from SGLang's switches, read now (``resume``: :meth:`CaptureState.open`).
    :raises ValueError: one is invalid."""
    resolution, guard = session_switches(os.environ)
    plan = plan_session(resolution, engine=state.engine, shared_buffer=shared_buffer(), guard=guard)
    state.open(plan, resume)
    return plan


def apply_runner_rows(output: Any, rows: object) -> Any:
    """Trim to ``rows`` (``cuda_graph_output_rows``; ``None``: unchanged) the leaves whose leading
    dim is the largest among the output's leaves (the padded row dim); others keep their rows."""
    rows = check_rows("cuda_graph_output_rows", rows)
    if rows is None:
        return output
    if rows < 0:
        raise ValueError(f"cuda_graph_output_rows() returned {rows}; expected None or an int >= 0")
    node, leaves = flatten(output)
    padded = max((t.shape[0] for _, t in leaves if t.dim() > 0), default=None)
    if padded is None or rows >= padded:
        return output
    return unflatten(node, [t[:rows] if t.dim() > 0 and t.shape[0] == padded else t for _, t in leaves])


def check_rows(name: str, rows: object) -> int | None:
    """``rows``, what the runner's hook ``name`` returned. :raises TypeError: neither ``None`` nor an int."""
    if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int)):
        raise TypeError(f"{name}() returned {rows!r}; expected None or an int >= 0")
    return rows


def drop_global_pool(pool: Any) -> bool:
    """After ``cleanup()``: forget SGLang's process-global pool handle when it is ``pool``, so the
    next session captures into a fresh pool (why: docs/sglang.md#recapture-in-one-process)."""
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

        return get_server_args()
    except (ImportError, ValueError, AttributeError):  # not published in this process
        return None
