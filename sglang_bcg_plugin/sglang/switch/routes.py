"""``GET``/``POST /bcg/output_mode`` in the launcher's HTTP server: the body, one switch at a time,
the status of each answer (docs/sglang.md#switching-the-mode-of-a-running-server-bcgoutput_mode)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ...errors import one_line
from ...output.mode import OutputMode, parse_mode
from .rpc import RpcClient

logger = logging.getLogger(__name__)

ROUTE = "/bcg/output_mode"
HTTP_TARGET = "sglang.srt.entrypoints.http_server._setup_and_run_http_server"
BODY_HELP = 'send {"mode": "off"|"on"|"released"}'


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
        mode = parse_mode(body["mode"], "mode")
    except (TypeError, ValueError) as exc:
        raise BodyError(one_line(exc)) from None
    if mode is None:
        raise BodyError(f"'mode' is null; {BODY_HELP}")
    return mode


class Busy(Exception):
    """A switch is running; its text is the one line the 409 says."""


#: How long a request waits for a ``GET`` in flight (a scheduler iteration and a snapshot of the allocator; a step
#: of incremental capture at most) before it is refused.
SHOW_WAIT_S = 30.0
SHOW = "show"  #: what a ``GET`` holds the gate for


class SwitchGate:
    """One exchange with the schedulers at a time: a switch refuses what comes while it runs, at once, never
    queued; behind a ``GET`` (short) a request waits up to :data:`SHOW_WAIT_S`."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, show_wait_s: float = SHOW_WAIT_S) -> None:
        self._lock = threading.Lock()
        self._clock, self._show_wait_s = clock, show_wait_s
        self.running: tuple[str, float] | None = None

    def _acquire(self) -> None:
        """Take the gate. :raises Busy: a switch holds it, or a ``GET`` longer than :data:`SHOW_WAIT_S`."""
        if self._lock.acquire(blocking=False):
            return
        held = self.running
        if held is None and self._lock.acquire(timeout=0.05):  # its holder was just starting, or ending
            return
        held = held or self.running
        if held is not None and held[0] == SHOW and self._lock.acquire(timeout=self._show_wait_s):
            return
        what, since = held or self.running or ("?", self._clock())
        doing = "a GET of the output mode is being answered" if what == SHOW else f"a switch to {what!r} is running"
        raise Busy(f"{doing} ({self._clock() - since:.0f} s so far); try again when it ends")

    @contextlib.contextmanager
    def hold(self, what: str) -> Any:
        self._acquire()
        self.running = (what, self._clock())
        try:
            yield
        finally:
            self.running = None
            self._lock.release()


def http_answer(client: RpcClient, gate: SwitchGate, mode: OutputMode | None) -> tuple[int, dict[str, Any]]:
    """(status, JSON) of a GET (``mode=None``) or a POST: 200, 409 busy (a switch running, or still capturing
    between batches), 422 refused, 500 a failed
    capture (rolled back), 504 no answer."""
    try:
        with gate.hold(mode or SHOW):
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
    """409 when the last switch still captures between batches, 422 when a rank refused (nothing was touched either
    way), else 500 with the first rank's error."""
    running = next((r["running"] for r in ranks if r.get("running")), None)
    if running:
        return 409, {**out, "error": running}
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
            return JSONResponse({"error": f"not supported with --dp-size {dp_size}: SGLang's RPC reaches one scheduler "
                                          "group"}, status_code=422)
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

    add_routes(http_server.app, RpcClient(port_args.rpc_ipc_name), SwitchGate(),
               int(getattr(server_args, "dp_size", 1) or 1))
    logger.info("sglang_bcg: %s registered (admin API key required)", ROUTE)
