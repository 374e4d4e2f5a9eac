"""The live switch in one TP rank's scheduler: whether it can re-capture, what it reports, and the
re-capture itself with its rollback (docs/sglang.md#switching-the-mode-of-a-running-server-bcgoutput_mode)."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch

from ..._constants import ENV_SHARE_OUTPUT
from ...errors import one_line
from ...output.mode import OutputMode, parse_mode
from ..flag import ENV_TEXT
from ..compat import SGLANG_BREAKABLE, tp_agree
from ..incremental import asked, defer_decode, paced_from, pending, switch_running, switching
from ..memory_plan import after_switch_line, forecast_modes, plan_made, switch_headroom, switch_refusal
from ..serving_capture import per_request_state, while_serving
from ..sglang_breakable import SharingPolicyMixin
from ..sglang_session import session_switches

logger = logging.getLogger(__name__)

class Refused(Exception):
    """The rank cannot switch; nothing was touched."""


class StillRunning(Exception):
    """The last switch still captures between batches (incremental capture); nothing was touched (HTTP 409)."""


def prefill_backend(model_runner: Any) -> Any:
    return getattr(getattr(model_runner, "prefill_cuda_graph_runner", None), "backend", None)


def recapture_refusal(model_runner: Any, seam_kind: str) -> str | None:
    """Why this rank cannot re-capture its prefill graphs, in one line; ``None`` when it can."""
    if seam_kind == "runner":
        return ("SGLang 0.5.13's BreakableCudaGraphRunner cannot drop its graphs (no cleanup; they stay in the "
                "process-global pool), so a re-capture would hold two sets: "
                "restart with --enable-bcg-shared-output=MODE")
    if seam_kind != "backend":
        return "this SGLang has no breakable CUDA graph the plugin hooks"
    if (state := per_request_state(model_runner)) is not None:
        return (f"this model keeps {state}, which a capture while serving would overwrite for requests in flight: "
                "restart with --enable-bcg-shared-output=MODE")
    backend = prefill_backend(model_runner)
    if not isinstance(backend, SharingPolicyMixin):
        device = str(getattr(model_runner, "device", "?"))
        if device != "cuda":
            return f"no prefill CUDA graphs in this server ({device} engine): nothing to re-capture"
        name = type(backend).__name__ if backend is not None else "none"
        return (f"the prefill graphs are not the plugin's {SGLANG_BREAKABLE} backend (prefill backend: {name}); "
                "start the server with --cuda-graph-backend-prefill breakable")
    if not callable(getattr(model_runner, "init_prefill_cuda_graph", None)):
        return "this SGLang's ModelRunner has no init_prefill_cuda_graph() to re-capture with"
    return None


def _pool_bytes(pool: Any) -> tuple[int | None, int | None]:
    """The bytes the caching allocator holds for graph pool ``pool`` and for every graph pool."""
    if not torch.cuda.is_available():
        return None, None
    pooled = [s for s in torch.cuda.memory_snapshot()  # pragma: no cover
              if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0)]
    mine = None if pool is None else sum(int(s["total_size"])  # pragma: no cover
                                         for s in pooled if tuple(s["segment_pool_id"]) == tuple(pool))
    return mine, sum(int(s["total_size"]) for s in pooled)  # pragma: no cover


def describe_rank(model_runner: Any, environ: MutableMapping[str, str] | None = None) -> dict[str, Any]:
    """What one rank reports: its process, the mode a capture resolves now, and its graphs."""
    env = os.environ if environ is None else environ
    backend = prefill_backend(model_runner)
    out: dict[str, Any] = {"pid": os.getpid(), "env": env.get(ENV_SHARE_OUTPUT),
                           "prefill_backend": type(backend).__name__ if backend is not None else None}
    if isinstance(backend, SharingPolicyMixin):
        resolution, report = backend.last_output_mode, backend.memory_report()
        out.update(mode=resolution and resolution.mode, reason=resolution and resolution.source,
                   keys=len(getattr(backend, "_graphs", {})), resident_output_bytes=int(report.resident_output_bytes),
                   logical_output_bytes=int(report.logical_output_bytes),
                   measured_graph_bytes=report.measured_graph_bytes)
        out["pool_bytes"], out["graph_pools_bytes"] = _pool_bytes(getattr(backend, "_pool", None))
        if (state := pending(getattr(model_runner, "prefill_cuda_graph_runner", None))) is not None:
            out["incremental"] = state.describe()
    else:  # the mode a capture would take from the variable (unset: the release's default)
        with contextlib.suppress(ValueError):
            out["mode"] = parse_mode(env.get(ENV_SHARE_OUTPUT), ENV_SHARE_OUTPUT, text=True)
        out["reason"] = ("no prefill graphs of the plugin in this process; "
                         f"{ENV_SHARE_OUTPUT}={env.get(ENV_SHARE_OUTPUT)!r}")
    if torch.cuda.is_available():  # pragma: no cover - CUDA only (tests/gpu/test_sglang_switch_gpu.py)
        free, total = torch.cuda.mem_get_info()
        out.update(free_bytes=int(free), total_bytes=int(total), reserved_bytes=int(torch.cuda.memory_reserved()))
    return out


def _on_cuda(call: str) -> None:
    """``torch.cuda.<call>()`` (``synchronize``, ``empty_cache``) where there is CUDA."""
    if torch.cuda.is_available():  # pragma: no cover - CUDA only
        getattr(torch.cuda, call)()


def _graph_runner(model_runner: Any, name: str) -> Any:
    """The model runner's ``name`` runner where it holds graphs (``None``: none, or the eager runner)."""
    runner, eager = getattr(model_runner, name, None), getattr(model_runner, "eager_runner", None)
    held = runner is not None and runner is not eager and getattr(runner, "backend", None) is not None
    return runner if held else None


def _drop_graphs(model_runner: Any, parts: dict[str, float] | None = None,
                 names: tuple[str, ...] = ("prefill_cuda_graph_runner", "decode_cuda_graph_runner"),
                 forget_pool: bool = True) -> bool:
    """Drop the graphs of the runners ``names`` (prefill and decode; not the eager runner) and, with
    ``forget_pool``, SGLang's global graph pool, so the next capture starts a fresh pool; whether decode graphs were
    dropped. ``parts``, where given, gains the seconds of each part (``destroy_s``: the runners' cleanup,
    ``collect_s``, ``empty_cache_s``)."""
    clock = time.perf_counter()
    decode = False
    for name in names:
        if (runner := _graph_runner(model_runner, name)) is not None:
            runner.backend.cleanup()
            setattr(model_runner, name, None)
            decode = decode or name.startswith("decode")
    runner = None  # the loop's last runner must not outlive the collection below
    sglang_pool = sys.modules.get("sglang.srt.model_executor.runner_utils.pool")  # a stand-in runner: none
    if sglang_pool is not None and forget_pool:
        sglang_pool.set_global_graph_memory_pool(None)
    destroyed = time.perf_counter()
    gc.collect()
    collected = time.perf_counter()
    _on_cuda("empty_cache")
    if parts is not None:
        for key, seconds in (("destroy_s", destroyed - clock), ("collect_s", collected - destroyed),
                             ("empty_cache_s", time.perf_counter() - collected)):
            parts[key] = round(parts.get(key, 0.0) + seconds, 3)
    return decode


#: Without a memory plan, what must stay free (besides the new mode's prefill graphs) for the old decode graphs to
#: keep serving until the new ones are captured: the eager forward's working set, which the plan would measure.
KEEP_DECODE_MARGIN = 2 * 1024**3


def _keeps_decode(model_runner: Any, need: int) -> bool:
    """With incremental capture, after the prefill graphs were dropped: whether the old decode graphs may serve
    until the step that captures the new ones (else decode runs eagerly until then). They hold the old pool's
    segments they use (``_pool_bytes`` now), so they stay where what is free beyond those segments fits ``need``
    (the new mode's prefill graphs) and the plan's eager working set and margin (:data:`KEEP_DECODE_MARGIN` without
    a plan). Every TP rank agrees (a decode batch runs graphed on all ranks or none)."""
    fits = 0
    if _graph_runner(model_runner, "decode_cuda_graph_runner") is not None:
        pinned = _pool_bytes(None)[1] or 0
        fits = int(_free_bytes() - pinned - need >= switch_headroom(KEEP_DECODE_MARGIN))
    return tp_agree(fits, largest=False) == 1


def _new_decode(model_runner: Any) -> None:
    """Drop the old decode graphs (kept by the switch, :func:`_keeps_decode`), then capture new ones into the pool
    the new prefill graphs started, as a fresh start-up does."""
    _drop_graphs(model_runner, names=("decode_cuda_graph_runner",), forget_pool=False)
    model_runner.init_decode_cuda_graph()


def _drop_old(model_runner: Any, modes: Mapping[str, Any], mode: OutputMode,
              parts: dict[str, float]) -> tuple[bool, Callable[[], Any] | None]:
    """A switch's drop of the old graphs: whether the old decode graphs were kept (:func:`_keeps_decode`), and the
    capture of the new decode graphs (``None``: the server has none)."""
    keep = False
    if asked() and _graph_runner(model_runner, "decode_cuda_graph_runner") is not None:
        # incremental: the old decode graphs may serve until the new ones come (decode runs eagerly otherwise)
        # what the new prefill graphs take: the forecast's; without one, at most the old pools and every output
        need = int(modes[mode].total_bytes) if mode in modes else (
            (_pool_bytes(None)[1] or 0) + int(prefill_backend(model_runner).memory_report().logical_output_bytes))
        _drop_graphs(model_runner, parts, names=("prefill_cuda_graph_runner",))
        keep = _keeps_decode(model_runner, need)
    if keep:
        return True, lambda: _new_decode(model_runner)
    return False, model_runner.init_decode_cuda_graph if _drop_graphs(model_runner, parts) else None


def _capture(model_runner: Any, decode: Callable[[], Any] | None) -> bool:
    """SGLang's own start-up captures, in start-up order (``decode``: the decode graphs' capture, ``None``: none);
    with incremental capture no prefill size is captured here and ``decode`` is left to the first step after the
    largest size, the prefill sizes to the steps. Whether sizes are left to capture between batches."""
    # requests in flight keep their KV (sglang/serving_capture.py); the drop collected already, and the tail does
    with while_serving(), switching():
        model_runner.init_prefill_cuda_graph()
        runner = getattr(model_runner, "prefill_cuda_graph_runner", None)
        if decode is not None and not defer_decode(runner, decode):
            decode()
    state = pending(runner)
    return state is not None and bool(state.sizes)


def switch_rank(model_runner: Any, mode: OutputMode, seam_kind: str,
                environ: MutableMapping[str, str] | None = None,
                check: Callable[[Mapping[str, str]], object] = session_switches) -> dict[str, Any]:
    """Re-capture this rank's prefill graphs in ``mode`` (``check``: the release can serve it); its
    report, with ``error`` and ``rolled_back`` on a failed capture (:raises Refused: untouched; :raises StillRunning:
    the last switch's sizes are still captured between batches, untouched)."""
    env = os.environ if environ is None else environ
    why = recapture_refusal(model_runner, seam_kind)
    if why is not None:
        raise Refused(why)
    previous_env, resolution = env.get(ENV_SHARE_OUTPUT), prefill_backend(model_runner).last_output_mode
    if (running := switch_running(getattr(model_runner, "prefill_cuda_graph_runner", None))) is not None:
        raise StillRunning(f"a switch to {resolution and resolution.mode!r} is running: {running}; try again when it "
                           "ends (GET /bcg/output_mode shows its progress)")
    try:
        check({**env, ENV_SHARE_OUTPUT: ENV_TEXT[mode]})
    except ValueError as exc:
        raise Refused(one_line(exc)) from None
    # the forecast: waited for (or made now) only where a memory plan checks the switch against it
    modes = forecast_modes(prefill_backend(model_runner), wait=plan_made())
    previous = resolution and resolution.mode
    if (why := switch_refusal(modes, previous, mode, _free_bytes())) is not None:
        raise Refused(why)
    start = time.perf_counter()
    _on_cuda("synchronize")  # a batch the overlap scheduler launched finishes on the old graphs
    drop: dict[str, float] = {}
    keep, decode = _drop_old(model_runner, modes, mode, drop)
    env[ENV_SHARE_OUTPUT] = ENV_TEXT[mode]
    result: dict[str, Any] = {"previous": resolution and resolution.mode, "mode": mode,
                              "decode_recaptured": decode is not None, "decode_kept": keep}
    phases = result["phases"] = {"drop_s": round(time.perf_counter() - start, 3)}
    result["drop_parts"] = drop  # where the drop's time goes (docs/sglang.md)
    later = False
    try:
        later = _capture(model_runner, decode)
        paced_from(getattr(model_runner, "prefill_cuda_graph_runner", None), start)
        got = prefill_backend(model_runner)
        done = got.last_output_mode if isinstance(got, SharingPolicyMixin) else None
        if done is None or done.mode != mode:
            raise RuntimeError(f"the re-captured prefill backend is {type(got).__name__}, not ours in mode {mode!r}")
        result["ok"] = True
    except Exception as exc:  # any capture failure is reported, then rolled back
        logger.exception("sglang_bcg: re-capture in output mode %r failed", mode)
        result.update(ok=False, error=f"{type(exc).__name__}: {one_line(exc)}",
                      rolled_back=_roll_back(model_runner, env, previous_env, decode is not None))
    phases["capture_s"] = round(time.perf_counter() - start - phases["drop_s"], 3)
    _on_cuda("synchronize")
    if not later:  # the old graphs went in the drop's collection; a failed capture's leftovers go here
        gc.collect()
    _on_cuda("empty_cache")  # the old pool, once nothing holds its blocks
    result["seconds"] = round(time.perf_counter() - start, 3)
    if result.get("ok") and (line := after_switch_line(modes, previous, mode, _free_bytes())) is not None:
        logger.info(line)
        result["memory_plan"] = line
    result.update(describe_rank(model_runner, env))
    return result


def _free_bytes() -> int:
    """Free device memory, the cache emptied (0 without CUDA)."""
    if not torch.cuda.is_available():
        return 0
    torch.cuda.empty_cache()  # pragma: no cover - CUDA only
    return int(torch.cuda.mem_get_info()[0])  # pragma: no cover


def _roll_back(model_runner: Any, env: MutableMapping[str, str], previous_env: str | None, decode: bool) -> bool:
    """Re-capture in the previous mode after a failed capture; ``False`` if that fails too (prefill
    and decode then run without graphs, as SGLang does when its capture is disabled)."""
    if previous_env is None:
        env.pop(ENV_SHARE_OUTPUT, None)
    else:
        env[ENV_SHARE_OUTPUT] = previous_env
    try:
        _drop_graphs(model_runner)  # the new mode's leftovers, and decode graphs the switch kept
        _capture(model_runner, model_runner.init_decode_cuda_graph if decode else None)
    except Exception:  # reported as rolled_back=False
        logger.exception("sglang_bcg: re-capturing the previous output mode failed too")
        model_runner.prefill_cuda_graph_runner = getattr(model_runner, "eager_runner", None)
        if decode:
            model_runner.decode_cuda_graph_runner = model_runner.prefill_cuda_graph_runner
        return False
    return True


def answer_rank(model_runner: Any, params: dict[str, Any], seam_kind: str) -> dict[str, Any]:
    """One rank's answer to ``{"action": "show"}`` or ``{"action": "switch", "mode": MODE}``."""
    try:
        if params.get("action") == "switch":
            mode = parse_mode(params.get("mode"), "mode")
            if mode is None:
                raise Refused("no mode given: the request names none")
            return switch_rank(model_runner, mode, seam_kind)
        return {**describe_rank(model_runner), "ok": True, "refusal": recapture_refusal(model_runner, seam_kind)}
    except Refused as exc:
        return {"ok": False, "refused": str(exc), "pid": os.getpid()}
    except StillRunning as exc:
        return {"ok": False, "running": str(exc), "pid": os.getpid()}
    except Exception as exc:  # the scheduler keeps serving; the HTTP side says why
        logger.exception("sglang_bcg: output mode request failed")
        return {"ok": False, "error": f"{type(exc).__name__}: {one_line(exc)}", "pid": os.getpid()}
