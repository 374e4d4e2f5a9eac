"""``GET``/``POST /bcg/output_mode``: the route in the launcher, SGLang's RPC in every TP rank's
scheduler, where :func:`switch_rank` re-captures (docs/sglang.md, "Switching the mode of a running
server")."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import gc
import importlib.util
import json
import logging
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch
import torch.distributed

from .._constants import ENV_SHARE_OUTPUT
from .._words import parse_word
from ..output.mode import MODES, OutputMode, parse_mode_text
from . import compat
from .flag import ENV_TEXT
from .sglang_breakable import SharingPolicyMixin
from .sglang_session import session_switches

logger = logging.getLogger(__name__)

ROUTE = "/bcg/output_mode"
RPC_METHOD = "sglang_bcg_output_mode"
HTTP_TARGET = "sglang.srt.entrypoints.http_server._setup_and_run_http_server"
RPC_TARGET = "sglang.srt.managers.scheduler.Scheduler.handle_rpc_request"
#: Each switch target and the module that holds it.
MODULES = {HTTP_TARGET: "sglang.srt.entrypoints.http_server", RPC_TARGET: "sglang.srt.managers.scheduler"}
#: target -> whether this process registers it: the HTTP hook in the launcher (not a multiprocessing
#: child, FastAPI installed), the RPC hook in schedulers (they import the scheduler before plugins).
WHERE: dict[str, Callable[[], bool]] = {
    HTTP_TARGET: lambda: multiprocessing.parent_process() is None and importlib.util.find_spec("fastapi") is not None,
    RPC_TARGET: lambda: "sglang.srt.managers.scheduler" in sys.modules,
}
#: How long the HTTP side waits for the schedulers' answer (a re-capture of a large model).
RPC_TIMEOUT_S = float(os.environ.get("SGLANG_BCG_SWITCH_TIMEOUT", "900"))
#: How long a request waits for a scheduler to take it.
SEND_TIMEOUT_MS = 10_000
BODY_HELP = 'send {"mode": "off"|"on"|"released"}'


def one_line(text: object) -> str:
    return " ".join(str(text).split())[:500]


def parse_mode(word: object) -> OutputMode:
    """:raises TypeError, ValueError: ``word`` is not an output mode."""
    return parse_word(word, {m: m for m in MODES}, "mode", kind="an output mode")


def defined_in_source(target: str, module: str) -> bool:
    """Whether ``module``'s source defines ``target`` (``module.func`` or ``module.Class.method``),
    read with ``ast``, without importing it (the HTTP server's module needs FastAPI)."""
    path = compat.sglang_source(module)
    body: list[ast.stmt] = [] if path is None else ast.parse(path.read_text(encoding="utf-8")).body
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    for part in target[len(module) + 1:].split("."):
        node = next((n for n in body if isinstance(n, kinds) and n.name == part), None)
        if node is None:
            return False
        body = node.body
    return True


def doctor_line(seam_kind: str) -> str:
    """``sglang-bcg doctor``'s one line on the live switch."""
    missing = [t for t, m in MODULES.items() if not defined_in_source(t, m)]
    if seam_kind not in ("backend", "runner"):
        return "not available (no breakable CUDA graph to switch)"
    if missing:
        return f"not available on this release: {', '.join(missing)} not found"
    where = (f"GET/POST {ROUTE} registered only when the server starts with --admin-api-key (SGLang's admin "
             "authentication); without it the route does not exist")
    if seam_kind == "runner":
        return where + "; on this release a POST is refused (its runner cannot drop its graphs)"
    return where + "; sglang-bcg switch --url URL --api-key KEY off|on|released"


class BodyError(ValueError):
    """A POST body that is not ``{"mode": MODE}``; its text is the one line the 400 says."""


def parse_body(raw: bytes) -> OutputMode:
    """The mode a POST body ``{"mode": MODE}`` asks for (:raises BodyError: anything else)."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BodyError(f"the body is not JSON ({one_line(exc)}); {BODY_HELP}") from None
    if not isinstance(body, dict):
        raise BodyError(f"the body must be a JSON object, got {type(body).__name__}; {BODY_HELP}")
    extra = sorted(str(k) for k in body if k != "mode")
    if extra:
        raise BodyError(f"unknown key(s) {', '.join(map(repr, extra))}; {BODY_HELP}")
    if "mode" not in body:
        raise BodyError(f"no 'mode' in the body; {BODY_HELP}")
    try:
        return parse_mode(body["mode"])
    except (TypeError, ValueError) as exc:
        raise BodyError(one_line(exc)) from None


class Refused(Exception):
    """The rank cannot switch; nothing was touched."""


def prefill_backend(model_runner: Any) -> Any:
    return getattr(getattr(model_runner, "prefill_cuda_graph_runner", None), "backend", None)


def refusal(model_runner: Any, seam_kind: str) -> str | None:
    """Why this rank cannot re-capture its prefill graphs, in one line; ``None`` when it can."""
    if seam_kind == "runner":
        return ("SGLang 0.5.13's BreakableCudaGraphRunner cannot drop its graphs (no cleanup; they stay in the "
                "process-global pool), so a re-capture would hold two sets: restart with --enable-bcg-shared-output=MODE")
    if seam_kind != "backend":
        return "this SGLang has no breakable CUDA graph the plugin hooks"
    backend = prefill_backend(model_runner)
    if not isinstance(backend, SharingPolicyMixin):
        device = str(getattr(model_runner, "device", "?"))
        if device != "cuda":
            return f"no prefill CUDA graphs in this server ({device} engine): nothing to re-capture"
        name = type(backend).__name__ if backend is not None else "none"
        return (f"the prefill graphs are not the plugin's breakable backend (prefill backend: {name}); "
                "start the server with --cuda-graph-backend-prefill breakable")
    if not callable(getattr(model_runner, "init_prefill_cuda_graph", None)):
        return "this SGLang's ModelRunner has no init_prefill_cuda_graph() to re-capture with"
    return None


def _pool_bytes(pool: Any) -> tuple[int | None, int | None]:
    """The bytes the caching allocator holds for graph pool ``pool`` and for every graph pool."""
    if not torch.cuda.is_available():
        return None, None
    pooled = [s for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0)]  # pragma: no cover
    mine = None if pool is None else sum(int(s["total_size"]) for s in pooled if tuple(s["segment_pool_id"]) == tuple(pool))  # pragma: no cover
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
    else:  # the mode a capture would take from the variable (unset: the release's default)
        with contextlib.suppress(ValueError):
            out["mode"] = parse_mode_text(env.get(ENV_SHARE_OUTPUT))
        out["reason"] = f"no prefill graphs of the plugin in this process; {ENV_SHARE_OUTPUT}={env.get(ENV_SHARE_OUTPUT)!r}"
    if torch.cuda.is_available():  # pragma: no cover - CUDA only (tests/gpu/test_sglang_switch_gpu.py)
        free, total = torch.cuda.mem_get_info()
        out.update(free_bytes=int(free), total_bytes=int(total), reserved_bytes=int(torch.cuda.memory_reserved()))
    return out


def _on_cuda(call: str) -> None:
    """``torch.cuda.<call>()`` (``synchronize``, ``empty_cache``) where there is CUDA."""
    if torch.cuda.is_available():  # pragma: no cover - CUDA only
        getattr(torch.cuda, call)()


def _drop_graphs(model_runner: Any) -> bool:
    """Drop the prefill and decode graphs (not the eager runner) and SGLang's global graph pool, so
    the re-capture starts a fresh pool; whether decode graphs were dropped."""
    decode, eager = False, getattr(model_runner, "eager_runner", None)
    for name in ("prefill_cuda_graph_runner", "decode_cuda_graph_runner"):
        runner = getattr(model_runner, name, None)
        if runner is not None and runner is not eager and getattr(runner, "backend", None) is not None:
            runner.backend.cleanup()
            setattr(model_runner, name, None)
            decode = decode or name.startswith("decode")
    runner = None  # noqa: F841 - the loop's last runner must not outlive the collection below
    sglang_pool = sys.modules.get("sglang.srt.model_executor.runner_utils.pool")  # a stand-in runner: none
    if sglang_pool is not None:
        sglang_pool.set_global_graph_memory_pool(None)
    gc.collect()
    _on_cuda("empty_cache")
    return decode


def _capture(model_runner: Any, decode: bool) -> None:
    """SGLang's own start-up captures, in start-up order."""
    model_runner.init_prefill_cuda_graph()
    if decode:
        model_runner.init_decode_cuda_graph()


def switch_rank(model_runner: Any, mode: OutputMode, seam_kind: str,
                environ: MutableMapping[str, str] | None = None,
                check: Callable[[Mapping[str, str]], object] = session_switches) -> dict[str, Any]:
    """Re-capture this rank's prefill graphs in ``mode`` (``check``: the release can serve it); its
    report, with ``error`` and ``rolled_back`` on a failed capture (:raises Refused: untouched)."""
    env = os.environ if environ is None else environ
    why = refusal(model_runner, seam_kind)
    if why is not None:
        raise Refused(why)
    previous_env, resolution = env.get(ENV_SHARE_OUTPUT), prefill_backend(model_runner).last_output_mode
    try:
        check({**env, ENV_SHARE_OUTPUT: ENV_TEXT[mode]})
    except ValueError as exc:
        raise Refused(one_line(exc)) from None
    start = time.perf_counter()
    _on_cuda("synchronize")  # a batch the overlap scheduler launched finishes on the old graphs
    decode = _drop_graphs(model_runner)
    env[ENV_SHARE_OUTPUT] = ENV_TEXT[mode]
    result: dict[str, Any] = {"previous": resolution and resolution.mode, "mode": mode, "decode_recaptured": decode}
    try:
        _capture(model_runner, decode)
        got = prefill_backend(model_runner)
        done = got.last_output_mode if isinstance(got, SharingPolicyMixin) else None
        if done is None or done.mode != mode:
            raise RuntimeError(f"the re-captured prefill backend is {type(got).__name__}, not ours in mode {mode!r}")
        result["ok"] = True
    except Exception as exc:  # noqa: BLE001 - any capture failure is reported, then rolled back
        logger.exception("sglang_bcg: re-capture in output mode %r failed", mode)
        result.update(ok=False, error=f"{type(exc).__name__}: {one_line(exc)}",
                      rolled_back=_roll_back(model_runner, env, previous_env, decode))
    _on_cuda("synchronize")
    gc.collect()
    _on_cuda("empty_cache")  # the old pool, once nothing holds its blocks
    result["seconds"] = round(time.perf_counter() - start, 3)
    result.update(describe_rank(model_runner, env))
    return result


def _roll_back(model_runner: Any, env: MutableMapping[str, str], previous_env: str | None, decode: bool) -> bool:
    """Re-capture in the previous mode after a failed capture; ``False`` if that fails too (prefill
    and decode then run without graphs, as SGLang does when its capture is disabled)."""
    if previous_env is None:
        env.pop(ENV_SHARE_OUTPUT, None)
    else:
        env[ENV_SHARE_OUTPUT] = previous_env
    try:
        _drop_graphs(model_runner)
        _capture(model_runner, decode)
    except Exception:  # noqa: BLE001 - reported as rolled_back=False
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
            return switch_rank(model_runner, parse_mode(params.get("mode")), seam_kind)
        return {**describe_rank(model_runner), "ok": True, "refusal": refusal(model_runner, seam_kind)}
    except Refused as exc:
        return {"ok": False, "refused": str(exc), "pid": os.getpid()}
    except Exception as exc:  # noqa: BLE001 - the scheduler keeps serving; the HTTP side says why
        logger.exception("sglang_bcg: output mode request failed")
        return {"ok": False, "error": f"{type(exc).__name__}: {one_line(exc)}", "pid": os.getpid()}


def _gather(scheduler: Any, local: dict[str, Any]) -> list[dict[str, Any]]:
    """Every TP rank's answer (rank order), gathered on the TP group's CPU group."""
    tp_group = getattr(scheduler, "tp_group", None)
    if int(getattr(tp_group, "world_size", 1) or 1) == 1:
        return [local]
    out: list[Any] = [None] * int(tp_group.world_size)
    torch.distributed.all_gather_object(out, local, group=tp_group.cpu_group)
    return out


def around_handle_rpc_request(original_fn: Callable[..., Any], scheduler: Any, recv_req: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of ``Scheduler.handle_rpc_request``: answer our method, pass on the rest."""
    if getattr(recv_req, "method", None) != RPC_METHOD:
        return original_fn(scheduler, recv_req, *args, **kwargs)
    from sglang.srt.managers.io_struct import RpcReqOutput

    params = dict(getattr(recv_req, "parameters", None) or {})
    model_runner = getattr(getattr(scheduler, "tp_worker", None), "model_runner", None)
    local = answer_rank(model_runner, params, compat.seam_kind())  # never raises: every rank reaches the gather
    local["tp_rank"] = int(getattr(getattr(scheduler, "tp_group", None), "rank_in_group", 0) or 0)
    ranks = _gather(scheduler, local)
    message = json.dumps({"id": params.get("id"), "ranks": ranks})
    return RpcReqOutput(success=all(r.get("ok") for r in ranks), message=message)


class Busy(Exception):
    """A switch is running; its text is the one line the 409 says."""


class SwitchGate:
    """One switch at a time: a second is refused at once, never queued."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self.running: tuple[str, float] | None = None

    @contextlib.contextmanager
    def hold(self, what: str) -> Any:
        if not self._lock.acquire(blocking=False):
            mode, since = self.running or ("?", self._clock())
            raise Busy(f"a switch to {mode!r} is running ({self._clock() - since:.0f} s so far); try again when it ends")
        self.running = (what, self._clock())
        try:
            yield
        finally:
            self.running = None
            self._lock.release()


class RpcClient:
    """SGLang's RPC socket, bound here as ``Engine`` binds it (``launch_server`` makes no Engine)."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self._socket: Any = None
        self._next = 0

    def _open(self) -> Any:
        if self._socket is None:
            import zmq
            from sglang.srt.utils.network import get_zmq_socket

            self._context = zmq.Context(1)
            self._socket = get_zmq_socket(self._context, zmq.DEALER, self.endpoint, True)
            self._socket.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)  # no scheduler connected: not forever
        return self._socket

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._context.term()
            self._socket = None

    def call(self, params: dict[str, Any], timeout_s: float = RPC_TIMEOUT_S) -> tuple[bool, dict[str, Any]]:
        """Send ``params`` to every TP rank; their answers (``ranks``), skipping stale replies."""
        import zmq
        from sglang.srt.managers import io_struct

        sock = self._open()
        self._next += 1
        req = io_struct.RpcReqInput(method=RPC_METHOD, parameters={**params, "id": self._next})
        send, recv = getattr(io_struct, "sock_send", None), getattr(io_struct, "sock_recv", None)
        try:
            send(sock, req) if send is not None else sock.send_pyobj(req)  # noqa: B018 - 0.5.13-0.5.14 pickle
        except zmq.Again:
            raise TimeoutError(f"no scheduler took the request in {SEND_TIMEOUT_MS // 1000} s (is it running?)") from None
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0 and sock.poll(int(left * 1000)):
            out = recv(sock) if recv is not None else sock.recv_pyobj()
            try:
                body = json.loads(out.message)
            except (TypeError, ValueError):
                continue
            if body.get("id") == self._next:
                return bool(out.success), body
        raise TimeoutError(f"the schedulers did not answer in {timeout_s:.0f} s (SGLANG_BCG_SWITCH_TIMEOUT)")


def http_answer(client: RpcClient, gate: SwitchGate, mode: OutputMode | None) -> tuple[int, dict[str, Any]]:
    """(status, JSON) of a GET (``mode=None``) or a POST: 200, 409 busy, 422 refused, 500 a failed
    capture (rolled back), 504 no answer."""
    try:
        with gate.hold(mode or "show"):
            start = time.perf_counter()
            ok, body = client.call({"action": "show"} if mode is None else {"action": "switch", "mode": mode})
            seconds = round(time.perf_counter() - start, 3)
    except Busy as exc:
        return 409, {"error": str(exc)}
    except TimeoutError as exc:
        return 504, {"error": one_line(exc)}
    ranks = body.get("ranks", [])
    modes = {r.get("mode") for r in ranks}
    out: dict[str, Any] = {"mode": modes.pop() if len(modes) == 1 else sorted(map(str, modes)),
                           "pids": [r.get("pid") for r in ranks], "ranks": ranks}
    if mode is not None:
        out.update(seconds=seconds, previous=ranks[0].get("previous") if ranks else None)
    return (200, out) if ok else _failure(out, ranks)


def _failure(out: dict[str, Any], ranks: list[dict[str, Any]]) -> tuple[int, dict[str, Any]]:
    """422 when a rank refused (nothing was touched), else 500 with the first rank's error."""
    refused = next((r["refused"] for r in ranks if r.get("refused")), None)
    if refused:
        return 422, {**out, "error": f"refused: {refused}"}
    first = next((r["error"] for r in ranks if r.get("error")), "unknown error")
    if "seconds" not in out:
        return 500, {**out, "error": f"a scheduler could not answer: {first}"}
    then = (f"the previous mode {out.get('previous')!r} was re-captured"
            if all(r.get("rolled_back") for r in ranks if "rolled_back" in r)
            else "re-capturing the previous mode failed too: prefill runs without graphs")
    return 500, {**out, "error": f"re-capture failed: {first}; {then}"}


def add_routes(app: Any, client: RpcClient, gate: SwitchGate, dp_size: int = 1) -> None:
    """``GET``/``POST`` :data:`ROUTE` on SGLang's app, ``ADMIN_FORCE`` for its auth middleware."""
    from fastapi import Request
    from fastapi.responses import JSONResponse
    from sglang.srt.utils.auth import AuthLevel, auth_level

    async def reply(mode: OutputMode | None) -> Any:
        if dp_size > 1:
            return JSONResponse({"error": f"not supported with --dp-size {dp_size}: SGLang's RPC reaches one scheduler group"}, status_code=422)
        status, body = await asyncio.to_thread(http_answer, client, gate, mode)
        return JSONResponse(body, status_code=status)

    @auth_level(AuthLevel.ADMIN_FORCE)
    async def bcg_output_mode_get() -> Any:
        return await reply(None)

    @auth_level(AuthLevel.ADMIN_FORCE)
    async def bcg_output_mode_post(request: Request) -> Any:
        try:
            mode = parse_body(await request.body())
        except BodyError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        return await reply(mode)

    bcg_output_mode_post.__annotations__ = {"request": Request}  # a string here (PEP 563): FastAPI's query field
    app.add_api_route(ROUTE, bcg_output_mode_get, methods=["GET"])
    app.add_api_route(ROUTE, bcg_output_mode_post, methods=["POST"])


def before_setup_and_run_http_server(*args: Any, **kwargs: Any) -> None:
    """BEFORE hook of ``_setup_and_run_http_server(server_args, _, _, port_args)``: the route if ``--admin-api-key``."""
    server_args = kwargs.get("server_args", args[0] if args else None)
    port_args = kwargs.get("port_args", args[3] if len(args) > 3 else None)
    if not getattr(server_args, "admin_api_key", None):
        logger.info("sglang_bcg: %s not registered: the server has no --admin-api-key", ROUTE)
        return None
    if port_args is None or not getattr(port_args, "rpc_ipc_name", None):
        logger.warning("sglang_bcg: %s not registered: SGLang's RPC endpoint is unknown here", ROUTE)
        return None
    from sglang.srt.entrypoints import http_server

    add_routes(http_server.app, RpcClient(port_args.rpc_ipc_name), SwitchGate(), int(getattr(server_args, "dp_size", 1) or 1))
    logger.info("sglang_bcg: %s registered (admin API key required)", ROUTE)
