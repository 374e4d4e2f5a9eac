"""The live switch's SGLang side on the installed release (CI runs each release's real wheel).

The two targets :mod:`sglang_bcg_plugin.integration.switch` hooks exist in the release's source;
in a fresh interpreter that imported SGLang's scheduler (as a scheduler process has when it loads
plugins), ``load_plugins()`` wraps ``Scheduler.handle_rpc_request``, and SGLang's own RPC message
types and socket encoding carry a request from our HTTP-side client over a real ZMQ socket to the
hooked handler and back (a scheduler stand-in with a CPU model runner: the answer is the refusal).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import run_child

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


def test_switch_targets_exist_in_the_release() -> None:
    from sglang_bcg_plugin.integration.compat import seam_kind
    from sglang_bcg_plugin.integration.switch import MODULES, defined_in_source, doctor_line

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
from sglang_bcg_plugin.integration import switch
wrapped = hasattr(sched.Scheduler.handle_rpc_request, "__wrapped__")

import zmq
from sglang.srt.utils.network import get_zmq_socket
endpoint = "ipc://" + tempfile.mktemp(prefix="bcg-rpc-")
client = switch.RpcClient(endpoint)
client._open()  # bound here, as Engine binds it
runner = NS(device="cpu", prefill_cuda_graph_runner=None)
fake = NS(tp_worker=NS(model_runner=runner), tp_rank=0, tp_size=1)
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
gate = switch.SwitchGate()
shown = switch.http_answer(client, gate, None)
posted = switch.http_answer(client, gate, "off")
thread.join(30)
report(wrapped=wrapped, shown=shown, posted=posted, pid=os.getpid())
"""


def test_rpc_round_trip_through_the_hooked_scheduler_handler(dist_dir: Path) -> None:
    from sglang_bcg_plugin.integration.compat import seam_kind

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
