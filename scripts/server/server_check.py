"""One variant of a real SGLang server, end to end: start it, generate, measure, stop it.

    python scripts/server/server_check.py --model DIR --variant on [--plugin-path DIR] [--out v.json]

Starts ``python -m sglang.launch_server`` on 127.0.0.1 (a free port) with a model directory made
by ``make_model.py`` (``--load-format dummy``: SGLang's seeded random weights, the same in every
process) and the prefill breakable CUDA graph, in its own process group, its log in a file. The
variant decides what the plugin sees:

* ``stock``: the plugin is not importable (``--plugin-path`` is left off ``PYTHONPATH``);
* ``default``: the plugin installed, nothing set;
* ``on`` / ``off`` / ``released``: the plugin installed and the server's own command line says
  ``--enable-bcg-shared-output``, ``--no-enable-bcg-shared-output`` or
  ``--enable-bcg-shared-output=released``, with ``SGLANG_BCG_FORECAST=1`` (the forecast lines).

Then, through the HTTP server: ``/health``; greedy output ids (``/generate`` with ``input_ids``)
over prompts of 5 to 3500 tokens, one request at a time and as one batch; prefill and decode
throughput on a fixed batch; ``/v1/completions`` on a text prompt. Stops the server by its
process group and reads from its log SGLang's own "Capture ... prefill CUDA graph end ... mem
usage" line (free device memory lost over the prefill capture, 0.01 GB resolution) and the
plugin's forecast lines. Prints one ``RESULT {json}`` line and writes it to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

VARIANTS = ("stock", "default", "on", "off", "released")
FLAGS = {"on": ["--enable-bcg-shared-output"], "off": ["--no-enable-bcg-shared-output"],
         "released": ["--enable-bcg-shared-output=released"]}
#: Prompt lengths (tokens): one prefill graph each up to the chunk size, then chunked prefill.
LENGTHS = (5, 37, 200, 511, 900, 1500, 3000, 3500)
NEW_TOKENS = 12
GIB = 1 << 30
MIB = 1 << 20

_PREFILL_END = re.compile(r"Capture (?:\S+ )?prefill CUDA graph end\. elapsed=([\d.]+) s, mem usage=([\d.]+) GB")
_DECODE_END = re.compile(r"Capture (?:\S+ )?(?:decode )?cuda graph end\. bs=.*?elapsed=([\d.]+) s, mem usage=([\d.]+) GB",
                         re.IGNORECASE)
#: SGLang's own start-up figure (0.5.23: the scheduler from its start to ready, the captures in it).
_SCHEDULER = re.compile(r"Engine startup timings \(s\):.*?scheduler_e2e=([\d.]+)")
_FORECAST = re.compile(r"graph memory forecast for (\d+) sizes up to (\d+): ([\d,.]+) MiB with "
                       r"--enable-bcg-shared-output=(\w+); (.*)")
_AGAINST = re.compile(r"against (\w+) \(([\d,.]+) MiB\)")
_AFTER = re.compile(r"graph memory after capture: ([\d.]+) MiB \(graph pool ([\d.]+) MiB \+ shared buffer "
                    r"([\d.]+) MiB\); forecast ([\d.]+) MiB, error ([+-]?[\d.]+) %"
                    r"(?:; free device memory lost over the session ([\d.]+) MiB)?")


def prompts(count_lengths: tuple[int, ...] = LENGTHS, vocab: int = 380) -> list[list[int]]:
    """Deterministic token ids, every one a real token of make_model's tokenizer (< 380)."""
    return [[(7 * i + 3 * j) % (vocab - 4) + 4 for j in range(n)] for i, n in enumerate(count_lengths)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def release_flags(release: str | None = None) -> list[str]:
    """The prefill breakable graph and the decode graphs' batch sizes, in the installed release's
    words: 0.5.13 has one breakable runner (``--enable-breakable-cuda-graph``), no backend choice,
    one ``--cuda-graph-max-bs``, and imports flashinfer's sampling unless told to sample in torch."""
    if release is None:
        from importlib.metadata import version

        release = version("sglang")
    if release.startswith("0.5.13"):
        return ["--enable-breakable-cuda-graph", "--cuda-graph-max-bs", "16", "--sampling-backend", "pytorch"]
    return ["--cuda-graph-backend-prefill", "breakable", "--cuda-graph-max-bs-decode", "16"]


def server_command(model: str, port: int, variant: str, chunk: int, mem_fraction: float,
                   max_total_tokens: int, extra: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--load-format", "dummy",
           "--dtype", "bfloat16", "--host", "127.0.0.1", "--port", str(port), "--random-seed", "0",
           "--attention-backend", "triton", *release_flags(),
           "--chunked-prefill-size", str(chunk),
           "--disable-radix-cache", "--skip-server-warmup", "--grammar-backend", "none",
           "--mem-fraction-static", str(mem_fraction), "--max-total-tokens", str(max_total_tokens),
           "--log-level", "info"]
    return cmd + FLAGS.get(variant, []) + extra


def _holds_plugin(entry: str) -> bool:
    """Whether a ``PYTHONPATH`` entry holds the plugin (a checkout, an install target)."""
    return (Path(entry) / "sglang_bcg_plugin").exists()


def server_env(variant: str, plugin_path: str | None) -> dict[str, str]:
    env = dict(os.environ)
    for name in [n for n in env if n.startswith("SGLANG_BCG_") or n == "SGLANG_ENABLE_BCG_SHARED_OUTPUT"]:
        del env[name]  # nothing of ours set unless the variant says so
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != plugin_path
            and not (variant == "stock" and _holds_plugin(p))]
    if variant != "stock" and plugin_path:
        path.insert(0, plugin_path)
    env["PYTHONPATH"] = os.pathsep.join(path)
    if variant in FLAGS and os.environ.get("SGLANG_BCG_SERVER_FORECAST", "1") != "0":  # 0: no forecast lines
        env["SGLANG_BCG_FORECAST"] = "1"
        if trace_dir := os.environ.get("SGLANG_BCG_SERVER_TRACE_DIR"):  # per-size memory, a diagnostic
            env["SGLANG_BCG_FORECAST_TRACE"] = str(Path(trace_dir) / f"trace-{variant}.json")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _post(url: str, body: dict[str, Any], timeout: float) -> Any:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - 127.0.0.1 only
        return json.loads(r.read())


def wait_healthy(base: str, proc: subprocess.Popen[bytes], timeout: float) -> float:
    start = time.time()
    while time.time() - start < timeout:
        if proc.poll() is not None:
            msg = f"the server exited with {proc.returncode} before /health answered"
            raise RuntimeError(msg)
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:  # noqa: S310
                if r.status == 200:
                    return time.time() - start
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(1.0)
    msg = f"/health did not answer within {timeout:.0f} s"
    raise TimeoutError(msg)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def generate(base: str, ids: Any, new_tokens: int, timeout: float) -> Any:
    sp = {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}
    return _post(base + "/generate", {"input_ids": ids, "sampling_params": sp}, timeout)


def throughput(base: str, timeout: float) -> dict[str, float]:
    """Prefill tokens/s (8 prompts of 2048 tokens, one new token) and decode tokens/s (16 prompts
    of 32 tokens, 128 new tokens each); the better of two rounds."""
    prefill_ids, decode_ids = prompts((2048,) * 8), prompts((32,) * 16)
    best: dict[str, float] = {"prefill_tok_s": 0.0, "decode_tok_s": 0.0}
    for _ in range(2):
        t = time.perf_counter()
        generate(base, prefill_ids, 1, timeout)
        best["prefill_tok_s"] = max(best["prefill_tok_s"], 8 * 2048 / (time.perf_counter() - t))
        t = time.perf_counter()
        generate(base, decode_ids, 128, timeout)
        best["decode_tok_s"] = max(best["decode_tok_s"], 16 * 128 / (time.perf_counter() - t))
    return {k: round(v, 1) for k, v in best.items()}


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def parse_log(text: str) -> dict[str, Any]:
    """SGLang's capture lines and the plugin's forecast lines, as numbers."""
    found: dict[str, Any] = {}
    if m := _PREFILL_END.search(text):
        found["prefill_capture_s"], found["prefill_mem_gb"] = float(m.group(1)), float(m.group(2))
    if m := _DECODE_END.search(text):
        found["decode_capture_s"], found["decode_mem_gb"] = float(m.group(1)), float(m.group(2))
    if m := _SCHEDULER.search(text):
        found["scheduler_s"] = float(m.group(1))
    if m := _FORECAST.search(text):
        modes = {m.group(4): _number(m.group(3))}
        modes.update({name: _number(value) for name, value in _AGAINST.findall(m.group(5))})
        found["forecast"] = {"sizes": int(m.group(1)), "largest": int(m.group(2)), "mode": m.group(4),
                             "mib": modes}
    if m := _AFTER.search(text):
        found["after"] = {"measured_mib": float(m.group(1)), "pool_mib": float(m.group(2)),
                          "buffer_mib": float(m.group(3)), "forecast_mib": float(m.group(4)),
                          "error_pct": float(m.group(5)),
                          "lost_mib": float(m.group(6)) if m.group(6) else None}
    found["plugin_loaded"] = "sglang_bcg" in text
    return found


def run_variant(args: argparse.Namespace) -> dict[str, Any]:
    args.model = str(Path(args.model).resolve())
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = Path(args.log or f"server-{args.variant}.log").resolve()
    cmd = server_command(args.model, port, args.variant, args.chunked_prefill_size, args.mem_fraction_static,
                         args.max_total_tokens, args.server_arg)
    result: dict[str, Any] = {"variant": args.variant, "command": " ".join(cmd[1:]), "ok": False}
    t0 = time.time()
    # cwd: an empty directory, so a checkout (its *.egg-info entry points) is never on the path
    workdir = tempfile.mkdtemp(prefix=f"sglang-{args.variant}-")
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=server_env(args.variant, args.plugin_path),
                                cwd=workdir, start_new_session=True)
    try:
        result["server_up_s"] = round(wait_healthy(base, proc, args.start_timeout), 1)
        ids = prompts()
        result["outs"] = [generate(base, x, NEW_TOKENS, args.timeout)["output_ids"] for x in ids]
        result["batch"] = [o["output_ids"] for o in generate(base, ids, NEW_TOKENS, args.timeout)]
        if args.throughput:
            result["throughput"] = throughput(base, args.timeout)
        if args.completions:
            body = {"model": args.model, "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}
            reply = _post(base + "/v1/completions", body, args.timeout)
            result["completion"] = reply["choices"][0]["text"]
        result["ok"] = True
    except Exception as exc:  # noqa: BLE001 - reported in the result, with the log's tail
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        stop(proc)
        result["wall_s"] = round(time.time() - t0, 1)
    text = log_path.read_text(errors="replace")
    result.update(parse_log(text))
    if not result["ok"]:
        result["log_tail"] = text[-4000:]
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a model directory (make_model.py)")
    ap.add_argument("--variant", required=True, choices=VARIANTS)
    ap.add_argument("--plugin-path", help="the directory the plugin is installed in (pip --target)")
    ap.add_argument("--chunked-prefill-size", type=int, default=4096)
    ap.add_argument("--mem-fraction-static", type=float, default=0.3)
    ap.add_argument("--max-total-tokens", type=int, default=131072)
    ap.add_argument("--server-arg", action="append", default=[], help="one more launch_server argument")
    ap.add_argument("--no-throughput", dest="throughput", action="store_false")
    ap.add_argument("--no-completions", dest="completions", action="store_false")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    ap.add_argument("--log", help="the server's log file (default server-VARIANT.log)")
    ap.add_argument("--out", help="write the result JSON here")
    args = ap.parse_args(argv)
    result = run_variant(args)
    line = json.dumps(result)
    if args.out:
        Path(args.out).write_text(line + "\n")
    print("RESULT " + line, flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
