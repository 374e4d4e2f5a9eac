"""A diagnostic on the GPU machine: an incremental-capture server under concurrent load, per variant.

Starts ``launch_server`` (scripts/server/server_check.py's command, ``on`` mode,
``SGLANG_BCG_INCREMENTAL_CAPTURE=1``), posts the switch test's prompts from WORKERS threads for
SECONDS, and reports per variant: answers, failures, whether the server died, and the log's first
error lines. A variant is a comma list of: ``blocking`` (CUDA_LAUNCH_BLOCKING=1), ``nooverlap``
(``--disable-overlap-schedule``), ``first`` (no incremental capture: every size captured first).

    python scripts/server/incremental_stress.py OUT_DIR --shape llama3-8b --seconds 45 plain blocking nooverlap
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CHUNK = {"tiny": 4096, "llama3-8b": 16384}
LENGTHS = (5, 37, 200, 511, 900, 1500)


def _module(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(check: Any, model: Path, variant: str, shape: str, seconds: float, workers: int, out: Path) -> dict[str, Any]:
    flags = set(variant.split(","))
    port = check.free_port()
    base = f"http://127.0.0.1:{port}"
    extra = ["--disable-overlap-schedule"] if "nooverlap" in flags else []
    cmd = check.server_command(str(model), port, "on", CHUNK[shape], 0.3 if shape == "tiny" else 0.5, 131072, extra)
    env = check.server_env("on", os.environ["PLUGIN_SITE"])
    if "first" not in flags:
        env["SGLANG_BCG_INCREMENTAL_CAPTURE"] = "1"
    if "blocking" in flags:
        env["CUDA_LAUNCH_BLOCKING"] = "1"
    log = out / f"stress-{variant.replace(',', '+')}.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True, env=env,
                                cwd=tempfile.mkdtemp(prefix="sglang-stress-"))
    found: dict[str, Any] = {"variant": variant, "answers": 0, "failures": [], "died": False}
    try:
        t0 = time.time()
        check.wait_healthy(base, proc, 600)
        found["healthy_s"] = round(time.time() - t0, 1)
        prompts = check.prompts(LENGTHS)
        stop, lock = threading.Event(), threading.Lock()

        def work(w: int) -> None:
            i = w
            while not stop.is_set() and proc.poll() is None:
                try:
                    check.generate(base, prompts[i % len(prompts)], 12, 120)
                    with lock:
                        found["answers"] += 1
                except Exception as exc:  # noqa: BLE001 - a failure is the finding
                    with lock:
                        found["failures"].append(f"{type(exc).__name__}: {exc}"[:200])
                    time.sleep(0.5)
                i += workers

        threads = [threading.Thread(target=work, args=(w,), daemon=True) for w in range(workers)]
        for t in threads:
            t.start()
        end = time.time() + seconds
        while time.time() < end and proc.poll() is None:
            time.sleep(0.5)
        stop.set()
        for t in threads:
            t.join(130)
        found["died"] = proc.poll() is not None
    except Exception as exc:  # noqa: BLE001
        found["error"] = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        check.stop(proc)
    text = log.read_text(errors="replace")
    lines = text.splitlines()
    first = next((i for i, line in enumerate(lines) if "Traceback" in line or "illegal" in line), None)
    found["first_error"] = lines[first:first + 40] if first is not None else None
    found["incremental_lines"] = [line[-220:] for line in lines if "incremental capture" in line][-6:]
    found["failures"] = found["failures"][:5]
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(CHUNK))
    ap.add_argument("--seconds", type=float, default=45.0)
    ap.add_argument("--workers", type=int, default=4)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    check, make = _module("server_check"), _module("make_model")
    model = make.make_model(Path(tempfile.mkdtemp(prefix="stress-model-")) / args.shape, **make.SHAPES[args.shape])
    results = []
    for variant in args.variants:
        results.append(run(check, model, variant, args.shape, args.seconds, args.workers, args.out))
        print(json.dumps(results[-1], indent=1), flush=True)
        (args.out / "stress.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
