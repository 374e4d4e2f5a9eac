"""The live switch's SGLang side on the installed release (CI runs each release's real wheel).

The two targets :mod:`sglang_bcg_plugin.sglang.switch` hooks exist in the release's source;
in a fresh process that imported SGLang's scheduler (as a scheduler process has when it loads
plugins), ``load_plugins()`` wraps ``Scheduler.handle_rpc_request``, and SGLang's own RPC message
types and socket encoding carry a request from our HTTP-side client over a real ZMQ socket to the
hooked handler and back (a scheduler stand-in with a CPU model runner: the answer is the refusal).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from conftest import run_child

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


def test_switch_targets_exist_in_the_release() -> None:
    from sglang_bcg_plugin.sglang.compat import seam_kind
    from sglang_bcg_plugin.sglang.doctor import SWITCH_MODULES as MODULES
    from sglang_bcg_plugin.sglang.doctor import defined_in_source
    from sglang_bcg_plugin.sglang.doctor import switch_doctor_line as doctor_line

    assert all(defined_in_source(t, m) for t, m in MODULES.items()), MODULES
    assert not defined_in_source("sglang.srt.managers.scheduler.Scheduler.no_such_method", "sglang.srt.managers.scheduler")
    line = doctor_line(seam_kind())
    assert line.startswith("GET/POST /bcg/output_mode registered only when the server starts with --admin-api-key"), line


ROUND_TRIP = """
import os, tempfile, threading, json
from types import SimpleNamespace as NS
import sglang.srt.managers.scheduler as sched
from sglang.srt.plugins import load_plugins
from sglang.srt.managers import io_struct
load_plugins()
from sglang_bcg_plugin.sglang.switch import routes, rpc
wrapped = hasattr(sched.Scheduler.handle_rpc_request, "__wrapped__")

import zmq
from sglang.srt.utils.network import get_zmq_socket
endpoint = "ipc://" + tempfile.mktemp(prefix="bcg-rpc-")
client = rpc.RpcClient(endpoint)
client._open()  # bound here, as Engine binds it
runner = NS(device="cpu", prefill_cuda_graph_runner=None)
fake = NS(tp_worker=NS(model_runner=runner), tp_group=NS(world_size=1, rank_in_group=0))
send = getattr(io_struct, "sock_send", None)
recv = getattr(io_struct, "sock_recv", None)

def scheduler_side(n):
    sock = get_zmq_socket(zmq.Context(1), zmq.DEALER, endpoint, False)  # as SchedulerIpcChannels connects
    for _ in range(n):
        req = recv(sock) if recv else sock.recv_pyobj()
        out = sched.Scheduler.handle_rpc_request(fake, req)
        send(sock, out) if send else sock.send_pyobj(out)

thread = threading.Thread(target=scheduler_side, args=(2,), daemon=True)
thread.start()
gate = routes.SwitchGate()
shown = routes.http_answer(client, gate, None)
posted = routes.http_answer(client, gate, "off")
thread.join(30)
report(wrapped=wrapped, shown=shown, posted=posted, pid=os.getpid())
"""


def test_rpc_round_trip_through_the_hooked_scheduler_handler(dist_dir: Path) -> None:
    from sglang_bcg_plugin.sglang.compat import seam_kind

    r = run_child(ROUND_TRIP, dist_dir, timeout=240).result
    assert r["wrapped"]
    # 0.5.13 (the runner seam): refused with that reason, whatever the engine
    why = ("SGLang 0.5.13's BreakableCudaGraphRunner cannot drop its graphs" if seam_kind() == "runner"
           else "no prefill CUDA graphs in this server (cpu engine): nothing to re-capture")
    status, body = r["shown"]
    assert status == 200 and body["pids"] == [r["pid"]] and body["ranks"][0]["tp_rank"] == 0, body
    assert body["ranks"][0]["refusal"].startswith(why), body
    status, body = r["posted"]
    assert status == 422 and body["error"].startswith(f"refused: {why}"), body


def test_rpc_round_trip_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same round trip in this process (the hook called as HookRegistry would call it)."""
    import tempfile
    import threading
    from types import SimpleNamespace as NS

    import zmq

    with warnings.catch_warnings():  # SGLang's import-time warnings on CPU (conftest.py)
        warnings.simplefilter("ignore")
        from sglang.srt.managers import io_struct
        from sglang.srt.utils.network import get_zmq_socket

    from sglang_bcg_plugin.sglang.switch import routes, rpc

    endpoint = "ipc://" + tempfile.mktemp(prefix="bcg-rpc-")
    client = rpc.RpcClient(endpoint)
    client._open()
    fake = NS(tp_worker=NS(model_runner=NS(device="cpu", prefill_cuda_graph_runner=None)))
    send, recv = getattr(io_struct, "sock_send", None), getattr(io_struct, "sock_recv", None)
    passed_on = []

    def sglangs(scheduler: object, req: object) -> object:
        passed_on.append(req)
        return io_struct.RpcReqOutput(success=True, message="")

    def scheduler_side() -> None:
        context = zmq.Context(1)
        sock = get_zmq_socket(context, zmq.DEALER, endpoint, False)
        stale = io_struct.RpcReqOutput(success=True, message='{"id": -1}')  # a late reply to an older call
        for _ in range(2):
            req = recv(sock) if recv else sock.recv_pyobj()
            out = rpc.around_handle_rpc_request(sglangs, fake, req)
            for msg in (stale, out):
                send(sock, msg) if send else sock.send_pyobj(msg)
        sock.recv()  # a third request, taken and never answered
        done.wait(30)
        sock.close(linger=0)
        context.term()

    done = threading.Event()
    thread = threading.Thread(target=scheduler_side, daemon=True)
    thread.start()
    ok, body = client.call({"action": "show"}, timeout_s=60)
    assert ok and body["ranks"][0]["refusal"].startswith(("no prefill CUDA graphs", "SGLang 0.5.13's")), body
    assert body["ranks"][0]["pid"] == __import__("os").getpid()
    status, answer = routes.http_answer(client, routes.SwitchGate(), "released")
    assert status == 422 and answer["error"].startswith("refused: "), answer
    with pytest.raises(TimeoutError, match="did not answer in 0 s"):
        client.call({"action": "show"}, timeout_s=0.2)
    done.set()
    thread.join(30)
    assert passed_on == []  # only our method was asked
    client.close()
    client = rpc.RpcClient("ipc://" + tempfile.mktemp(prefix="bcg-rpc-"))
    monkeypatch.setattr(rpc, "SEND_TIMEOUT_MS", 100)
    with pytest.raises(TimeoutError, match="no scheduler took the request"):  # nobody connected
        client.call({"action": "show"})
    client.close()


ROUTE = """
import warnings
warnings.simplefilter("ignore")
from types import SimpleNamespace as NS
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sglang.srt.utils.auth import add_api_key_middleware
from sglang_bcg_plugin.sglang.switch import routes, rpc

answers = {"show": (True, {"ranks": [{"ok": True, "mode": "on", "pid": 5, "tp_rank": 0}]}),
           "switch": (False, {"ranks": [{"ok": False, "refused": "no graphs", "pid": 5}]})}
rpc.RpcClient.call = lambda self, params, timeout_s=1: answers[str(params["action"])]
app = FastAPI()  # SGLang's http_server.app in a server (the hook on it: tests/server/test_server_cpu.py)
routes.add_routes(app, rpc.RpcClient("ipc://rpc"), routes.SwitchGate())  # what the hook adds with a key
add_api_key_middleware(app, api_key=None, admin_api_key="k")  # what _setup_and_run_http_server does next
web = TestClient(app)
auth = {"Authorization": "Bearer k"}
got = web.get(routes.ROUTE, headers=auth)
dp = FastAPI()
routes.add_routes(dp, rpc.RpcClient("ipc://rpc"), routes.SwitchGate(), dp_size=2)
report(
    get=[got.status_code, got.json()],
    no_key=web.get(routes.ROUTE).status_code,
    wrong_key=web.post(routes.ROUTE, json={"mode": "on"}, headers={"Authorization": "Bearer wrong"}).status_code,
    bad=[(r := web.post(routes.ROUTE, content=b"{", headers=auth)).status_code, r.json()],
    refused=[(r := web.post(routes.ROUTE, json={"mode": "off"}, headers=auth)).status_code, r.json()],
    dp=TestClient(dp).get(routes.ROUTE).json(),
)
"""


def test_route_behind_sglangs_admin_auth(dist_dir: Path) -> None:
    """The route on a FastAPI app with SGLang's own auth middleware, in a child interpreter (the
    hook itself, on SGLang's app, is tested against a real server: tests/server/test_server_cpu.py)."""
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    r = run_child(ROUTE, dist_dir).result
    assert r["get"][0] == 200 and r["get"][1]["mode"] == "on" and r["get"][1]["pids"] == [5], r
    assert r["no_key"] == 401 and r["wrong_key"] == 401, r
    assert r["bad"][0] == 400 and r["bad"][1]["error"].startswith("the body is not JSON"), r
    assert r["refused"] == [422, {**r["refused"][1], "error": "refused: no graphs"}], r
    assert "--dp-size 2" in r["dp"]["error"], r
