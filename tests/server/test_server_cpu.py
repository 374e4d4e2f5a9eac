"""A real SGLang 0.5.23 server on CPU with the plugin installed (CI).

One ``sglang.Engine`` and one ``python -m sglang.launch_server ... --enable-bcg-shared-output
--admin-api-key KEY``,
each in its own process group, on a tiny dummy-weight Llama (``scripts/server/make_model.py``,
``--load-format dummy``), with SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``: its
``torch_native`` attention and every layer's ``forward_native``) and ``--sleep-on-idle`` (an idle
scheduler otherwise polls without pause: half a core for as long as the tests run). Real: SGLang's
launcher, tokenizer, scheduler and detokenizer processes, its Llama, its HTTP server, our
``sglang.srt.plugins`` entry point as pip installed it, the flag on the command line, and
``sglang-bcg doctor``. No graphs are captured on CPU, so our backend seam is installed but not
called. Stand-ins, only for what cannot be installed with CPU torch 2.13 (``site/``):
``torchvision`` and the eight names of SGLang's CPU kernel package that 0.5.23 imports.

Every wait is bounded; a server is stopped by its process group, also when a test fails.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
#: Small enough to start in seconds on two cores; head_dim 64 keeps SGLang's rope off any JIT.
SHAPE = dict(hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, intermediate=512, vocab=384, max_pos=2048)
#: Bounds, in seconds: a server up (two cores, three processes importing SGLang), one request,
#: a stop.
START_S = 240
REQUEST_S = 60
STOP_S = 30
SAMPLING = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
#: The server's --admin-api-key: /bcg/output_mode exists only with it.
ADMIN_KEY = "bcg-test-admin-key"
PLUGIN_LOG = re.compile(r"^SGLANG_BCG_PLUGIN_LOG pid=(\d+) (.*)$", re.M)
#: What SGLang's plugin loader logs when our register() ran and its hooks were applied.
EXECUTED = "Executed general plugin: sglang_bcg"
APPLIED = "Applied 1 hook(s) to {target} (from: plugin=sglang_bcg, dist=sglang-bcg-plugin)"
TARGETS = (
    "sglang.srt.server_args.ServerArgs.add_cli_args",
    "sglang.srt.server_args.ServerArgs.from_cli_args",
    "sglang.srt.model_executor.runner_backend.utils.resolve_prefill_backend",
    "sglang.srt.model_executor.runner_backend.utils.resolve_decode_backend",
)


def _make_model_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_model", ROOT / "scripts" / "server" / "make_model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(_make_model_module().make_model(tmp_path_factory.mktemp("model"), **SHAPE))


def server_env() -> dict[str, str]:
    """The environment of every server process: stand-ins first on the path, SGLang's CPU engine,
    offline, and none of our switches set (the flag alone must decide)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SGLANG_ENABLE_BCG", "SGLANG_BCG_")) and k != "SGLANG_PLUGINS"}
    env.update({
        "PYTHONPATH": os.pathsep.join([str(HERE / "site"), *filter(None, [env.get("PYTHONPATH")])]),
        "SGLANG_USE_CPU_ENGINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
    })
    return env


def stop_group(proc: subprocess.Popen[Any]) -> None:
    """End ``proc``'s process group (it leads one): SIGTERM, then SIGKILL after ``STOP_S``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=STOP_S)
            break
        except subprocess.TimeoutExpired:
            continue
    # The scheduler and detokenizer may outlive the leader for a moment: the group, once more.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def plugin_lines(log: str) -> dict[int, list[str]]:
    """SGLang's plugin-loader lines, per process id."""
    out: dict[int, list[str]] = {}
    for pid, message in PLUGIN_LOG.findall(log):
        out.setdefault(int(pid), []).append(message)
    return out


def assert_plugin_ran(lines: dict[int, list[str]], pid: int, what: str) -> None:
    """Our entry point was loaded in process ``pid``, its register() ran and every hook was applied."""
    got = lines.get(pid, [])
    expected = [EXECUTED, *(APPLIED.format(target=t) for t in TARGETS)]
    missing = [e for e in expected if e not in got]
    assert not missing, f"{what} (pid {pid}) did not load the plugin: missing {missing}; its lines: {got}; all: {lines}"


def titled(children: list[dict[str, Any]], title: str) -> int:
    pids = [c["pid"] for c in children if c["title"].split()[:1] == [title]]
    assert len(pids) == 1, f"expected one {title} process, got {children}"
    return int(pids[0])


def assert_greedy_ids(ids: list[int], again: list[int]) -> None:
    assert len(ids) == SAMPLING["max_new_tokens"] and all(0 <= i < SHAPE["vocab"] for i in ids), ids
    assert ids == again, "greedy decoding of the same prompt gave different tokens"


def test_engine_generates_on_cpu_with_the_plugin_in_every_process(model_dir: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "engine_driver.py"), str(model_dir)], cwd=str(ROOT), env=server_env(),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        log, _ = proc.communicate(timeout=START_S + 4 * REQUEST_S)
    except subprocess.TimeoutExpired:
        stop_group(proc)
        log, _ = proc.communicate(timeout=STOP_S)
        pytest.fail(f"sglang.Engine did not finish in {START_S + 4 * REQUEST_S} s:\n{log[-6000:]}")
    finally:
        stop_group(proc)
    results = [ln for ln in log.splitlines() if ln.startswith("RESULT=")]
    assert proc.returncode == 0 and results, f"engine driver failed (rc={proc.returncode}):\n{log[-6000:]}"
    result = json.loads(results[-1][len("RESULT="):])
    assert_greedy_ids(result["ids"], result["ids_again"])
    # The text prompt went through SGLang's tokenizer: the same tokens as the model's own
    # tokenizer, so the same greedy continuation as those ids.
    assert result["text_prompt_tokens"] == len(result["text_ids"])
    assert result["text_output_ids"] == result["text_ids_output_ids"]
    assert isinstance(result["text"], str) and result["text"]
    lines = plugin_lines(log)
    assert_plugin_ran(lines, result["pid"], "the Engine's process")
    assert_plugin_ran(lines, titled(result["children"], "sglang::scheduler"), "the scheduler")
    assert_plugin_ran(lines, titled(result["children"], "sglang::detokenizer"), "the detokenizer")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _request(url: str, body: dict[str, Any] | None = None, timeout: float = REQUEST_S) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - our own 127.0.0.1 server
        return int(resp.status), resp.read()


class Server:
    """A ``launch_server`` process group, its log file and its URL."""

    def __init__(self, proc: subprocess.Popen[Any], log: Path, url: str) -> None:
        self.proc, self.log, self.url = proc, log, url

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        status, data = _request(self.url + path, body)
        assert status == 200, (path, status, data[:2000])
        return dict(json.loads(data))

    def wait_healthy(self) -> float:
        start = time.monotonic()
        while time.monotonic() - start < START_S:
            if self.proc.poll() is not None:
                pytest.fail(f"launch_server exited ({self.proc.returncode}) before /health:\n{self.text()[-6000:]}")
            with contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError):
                if _request(self.url + "/health", timeout=5)[0] == 200:
                    return time.monotonic() - start
            time.sleep(1)
        pytest.fail(f"launch_server not healthy after {START_S} s:\n{self.text()[-6000:]}")

    def children(self) -> list[dict[str, Any]]:
        import psutil

        out = []
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                out.append({"pid": child.pid, "title": " ".join(child.cmdline())})
        return out


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    port = _free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir),
           "--load-format", "dummy", "--device", "cpu", "--dtype", "bfloat16", "--disable-radix-cache",
           "--skip-server-warmup", "--grammar-backend", "none", "--random-seed", "0",
           "--max-total-tokens", "2048", "--chunked-prefill-size", "512", "--log-level", "info",
           "--host", "127.0.0.1", "--port", str(port), "--enable-bcg-shared-output",
           "--admin-api-key", ADMIN_KEY, "--sleep-on-idle"]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=str(ROOT), env=server_env(), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        srv = Server(proc, log, f"http://127.0.0.1:{port}")
        srv.wait_healthy()
        yield srv
    finally:
        stop_group(proc)


def test_launch_server_with_the_flag_serves_generate_and_completions(server: Server) -> None:
    ids = server.post("/generate", {"input_ids": [5, 6, 7, 8, 9, 10, 11], "sampling_params": SAMPLING})
    again = server.post("/generate", {"input_ids": [5, 6, 7, 8, 9, 10, 11], "sampling_params": SAMPLING})
    assert_greedy_ids(ids["output_ids"], again["output_ids"])
    prompt = "The quick brown fox jumps over the lazy dog."
    text = server.post("/generate", {"text": prompt, "sampling_params": SAMPLING})
    assert isinstance(text["text"], str) and text["text"], text
    assert text["meta_info"]["completion_tokens"] == SAMPLING["max_new_tokens"], text
    completion = server.post("/v1/completions", {"model": "default", "prompt": prompt, "max_tokens": 6,
                                                 "temperature": 0.0, "ignore_eos": True})
    assert completion["object"] == "text_completion" and completion["usage"]["completion_tokens"] == 6, completion
    # Greedy from the same prompt: the OpenAI route and /generate agree.
    assert completion["choices"][0]["text"] == text["text"], (completion, text)


def test_launch_server_loaded_the_plugin_and_parsed_the_flag(server: Server) -> None:
    children = server.children()
    scheduler = titled(children, "sglang::scheduler")
    lines = plugin_lines(server.text())
    assert_plugin_ran(lines, server.proc.pid, "the launcher")
    assert_plugin_ran(lines, scheduler, "the scheduler")
    assert_plugin_ran(lines, titled(children, "sglang::detokenizer"), "the detokenizer")
    # Our from_cli_args hook parsed --enable-bcg-shared-output in the launcher and exported the
    # mode before SGLang spawned the scheduler (server_env() sets none of our variables): the
    # scheduler started with it.
    environ = Path(f"/proc/{scheduler}/environ").read_bytes().split(b"\0")
    assert b"SGLANG_ENABLE_BCG_SHARED_OUTPUT=1" in environ, [e for e in environ if b"BCG" in e]


def test_doctor_in_the_server_environment() -> None:
    doctor = Path(sys.executable).with_name("sglang-bcg")
    assert doctor.exists(), f"{doctor}: the console script pip installs with the package"
    proc = subprocess.run([str(doctor), "doctor"], cwd=str(ROOT), env=server_env(), capture_output=True,
                          text=True, timeout=START_S, check=False)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "entry point (sglang.srt.plugins): sglang_bcg = sglang_bcg_plugin.sglang:register" in out, out
    assert out.startswith("SGLang 0.5.23 (supported)") and out.rstrip().endswith("doctor: ok"), out


def _call(url: str, method: str = "GET", data: bytes | None = None, key: str | None = ADMIN_KEY) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_S) as resp:  # noqa: S310 - our own 127.0.0.1 server
            return int(resp.status), json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return int(exc.code), json.loads(exc.read() or b"null")


def test_output_mode_route_reaches_the_scheduler_behind_sglangs_admin_auth(server: Server) -> None:
    route = server.url + "/bcg/output_mode"
    status, body = _call(route)
    assert status == 200, body
    scheduler = titled(server.children(), "sglang::scheduler")
    # The answer came from the scheduler process (SGLang's RPC, our AROUND hook there), not the launcher.
    assert body["pids"] == [scheduler] and body["ranks"][0]["tp_rank"] == 0, (body, scheduler)
    assert body["mode"] == "on" and body["ranks"][0]["env"] == "1", body
    assert body["ranks"][0]["refusal"] == "no prefill CUDA graphs in this server (cpu engine): nothing to re-capture"
    # SGLang's own middleware: no key or a wrong one is its 401.
    assert _call(route, key=None) == (401, {"error": "Unauthorized"})
    assert _call(route, key="wrong")[0] == 401
    assert _call(route, "POST", b'{"mode": "off"}', key=None)[0] == 401
    # A bad body: 400 with one line, never a traceback.
    for data, why in ((b"not json", "the body is not JSON"), (b"[1]", "must be a JSON object"),
                      (b'{"mode": "on", "x": 1}', "unknown key(s) 'x'"), (b"{}", "no 'mode'"),
                      (b'{"mode": "sometimes"}', "mode='sometimes' is not an output mode"),
                      (b'{"mode": 1}', "mode must be")):
        status, body = _call(route, "POST", data)
        assert status == 400 and why in body["error"] and "\n" not in body["error"], (data, status, body)
    # On CPU there is nothing to re-capture: refused with the reason, the mode unchanged.
    status, body = _call(route, "POST", b'{"mode": "off"}')
    assert status == 422, body
    assert body["error"] == "refused: no prefill CUDA graphs in this server (cpu engine): nothing to re-capture", body
    assert _call(route)[1]["mode"] == "on"
    # Generation still works after the control requests.
    ids = server.post("/generate", {"input_ids": [5, 6, 7, 8], "sampling_params": SAMPLING})
    assert len(ids["output_ids"]) == SAMPLING["max_new_tokens"]


def test_switch_client_against_the_server(server: Server) -> None:
    cli = Path(sys.executable).with_name("sglang-bcg")
    env = {**server_env(), "SGLANG_BCG_ADMIN_API_KEY": ""}

    def switch(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(cli), "switch", "--url", server.url, *args], cwd=str(ROOT), env=env,
                              capture_output=True, text=True, timeout=START_S, check=False)

    shown = switch("--api-key", ADMIN_KEY, "--show")
    scheduler = titled(server.children(), "sglang::scheduler")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith(f"output mode: on on 1 TP rank(s) (scheduler pid {scheduler})"), shown.stdout
    assert "waiting" in shown.stderr or "reading the output mode" in shown.stderr, shown.stderr  # the progress line
    refused = switch("--api-key", ADMIN_KEY, "off")
    assert refused.returncode == 1 and refused.stdout == "", refused
    assert refused.stderr.splitlines()[-1] == (
        "error: 422: refused: no prefill CUDA graphs in this server (cpu engine): nothing to re-capture"), refused.stderr
    unauthorized = switch("off")
    assert unauthorized.returncode == 1 and unauthorized.stderr.splitlines()[-1].startswith("error: 401 Unauthorized"), unauthorized
    for proc in (refused, unauthorized):
        assert "Traceback" not in proc.stderr
