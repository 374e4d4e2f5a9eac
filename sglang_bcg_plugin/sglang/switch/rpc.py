"""The live switch's transport: SGLang's RPC from the launcher to every TP rank's scheduler (the
client bound in the launcher, the AROUND hook of ``Scheduler.handle_rpc_request``, the TP gather)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

import torch.distributed

from .. import compat
from .rank import answer_rank

RPC_METHOD = "sglang_bcg_output_mode"
RPC_TARGET = "sglang.srt.managers.scheduler.Scheduler.handle_rpc_request"
#: How long the HTTP side waits for the schedulers' answer (a re-capture of a large model).
RPC_TIMEOUT_S = float(os.environ.get("SGLANG_BCG_SWITCH_TIMEOUT", "900"))
#: How long a request waits for a scheduler to take it.
SEND_TIMEOUT_MS = 10_000


def _gather(scheduler: Any, local: dict[str, Any]) -> list[dict[str, Any]]:
    """Every TP rank's answer (rank order), gathered on the TP group's CPU group."""
    tp_group = getattr(scheduler, "tp_group", None)
    world_size = int(getattr(tp_group, "world_size", 1) or 1)
    if tp_group is None or world_size == 1:
        return [local]
    out: list[Any] = [None] * world_size
    torch.distributed.all_gather_object(out, local, group=tp_group.cpu_group)
    return out


def around_handle_rpc_request(original_fn: Callable[..., Any], scheduler: Any, recv_req: Any,
                              *args: Any, **kwargs: Any) -> Any:
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
            send(sock, req) if send is not None else sock.send_pyobj(req)  # 0.5.13-0.5.14 pickle
        except zmq.Again:
            raise TimeoutError(f"no scheduler took the request in {SEND_TIMEOUT_MS // 1000} s "
                               "(is it running?)") from None
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
