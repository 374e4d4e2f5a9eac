"""Switch the output mode of a real SGLang server on the GPU while it serves (issue 37).

With ``scripts/server/server_check.py``'s server (``launch_server``, SGLang's Llama, prefill
breakable CUDA graph) and ``--admin-api-key``, one server after another (graph memory is
compared, so never two at once):

1. references, one fresh server per mode (``off``, ``released``, then ``on``: the start-up compares
   against it, and neither is then the host's first server): greedy output ids one
   request at a time, the graph memory the server reports (``GET /bcg/output_mode``: the graph
   pool's bytes and the resident output bytes), and the answers under the same concurrent load
   as below (a control: what a server that never switched answers under that batching);
   graph memory is the pool the prefill graphs live in, every graph pool of the process (a
   dropped pool still cached shows there) and the resident outputs;
2. the switch: a server started ``on``, a background load of concurrent greedy ``/generate``
   requests (``SGLANG_BCG_SWITCH_WORKERS``, default 4), and ``POST /bcg/output_mode``
   on → off → released → on, a second POST sent during one switch, ``GET`` after each.

With ``SGLANG_BCG_SWITCH_INCREMENTAL=1`` (docs/sglang.md#incremental-capture) the switched server, and one
more started idle, capture their prefill sizes between batches (``SGLANG_BCG_INCREMENTAL_CAPTURE=1``; the
fresh references still capture everything first): the idle one gives the start-up figures (first answer,
every size captured, graph memory then); the switched one serves the load from its first answer for
:data:`FIRST_MINUTE_S`, every size captured before the first switch, and after each switch the test waits
until every size is captured again (the first switch: at least :data:`FIRST_MINUTE_S`). Checked besides:
the longest answer overlapping a switch and its capture is at most 3 x the idle p99 latency (the fresh
``on`` server under the same load) plus the slowest capture of one size; the first answer comes earlier than
the fresh ``on`` server's by 90 % of its prefill capture; every size is captured within 1.2 x that capture;
graph memory then equals the fresh server's. ``SGLANG_BCG_SWITCH_MODES`` (default ``on,off,released``)
limits the modes (the switches go through them from ``on`` and back); ``SGLANG_BCG_SWITCH_MINUTE_S``
(default 60) is the first minute; ``SGLANG_BCG_SWITCH_PARTS`` (default ``fresh,startup,live``) the servers
this call starts, and ``SGLANG_BCG_SWITCH_RESUME`` (the JSON of an earlier call) takes its references and
start-up instead of starting them again: one call may then stay within a device call's limit.

Checked: every switch answers 200 in the mode asked, with its time; the second POST is 409 (with incremental
capture, also one sent once the switch answered, while its sizes are still captured between batches);
no request fails, and every answer equals the target mode's reference (one at a time, or an
answer a fresh server gave under the same load); graph memory after each switch equals the fresh
server's in that mode (±2 MiB). Needs a server bundle set up (``scripts/server/setup.sh``
exports ``PLUGIN_SITE``; ``scripts/server/gpu-server-check.sh`` does all of it, then run this
file); skipped otherwise. Results and every server's log:
``$SGLANG_BCG_GPU_RESULTS_DIR/sglang_switch.json``, ``switch-*.log``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from server_scripts import NEEDS_SERVER, load

SHAPE = os.environ.get("SGLANG_BCG_SERVER_SHAPE", "tiny")
CHUNK = {"tiny": 4096, "llama3-8b": 16384}
KEY = "bcg-gpu-switch-key"
MODES = tuple(os.environ.get("SGLANG_BCG_SWITCH_MODES", "on,off,released").split(","))
#: From ``on`` through the others and back: on → off → released → on.
SEQUENCE = (*MODES[1:], "on")
INCREMENTAL = os.environ.get("SGLANG_BCG_SWITCH_INCREMENTAL", "0") == "1"
#: Seconds of load from the first answer (and after the first switch) whose throughput is reported.
FIRST_MINUTE_S = float(os.environ.get("SGLANG_BCG_SWITCH_MINUTE_S", "60")) if INCREMENTAL else 0.0
#: The servers this call starts: the fresh references, the idle start-up (incremental only), the switched one;
#: a call of the first two leaves its JSON for a later call's ``SGLANG_BCG_SWITCH_RESUME``.
PARTS = tuple(os.environ.get("SGLANG_BCG_SWITCH_PARTS", "fresh,startup,live").split(","))
WORKERS = int(os.environ.get("SGLANG_BCG_SWITCH_WORKERS", "4"))
#: Prompt lengths (tokens): several prefill graph sizes, one chunk at most.
LENGTHS = (5, 37, 200, 511, 900, 1500)
NEW_TOKENS = 12
#: Bounds, in seconds.
START_S, REQUEST_S, SWITCH_S, CONTROL_S, SETTLE_S = 600.0, 300.0, 900.0, 20.0, 5.0
MIB = 1 << 20
TOLERANCE = 2 * MIB

pytestmark = NEEDS_SERVER



def admin(base: str, method: str = "GET", mode: str | None = None, timeout: float = REQUEST_S) -> tuple[int, Any]:
    data = None if mode is None else json.dumps({"mode": mode}).encode()
    req = urllib.request.Request(base + "/bcg/output_mode", data=data, method=method,
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - 127.0.0.1 only
            return int(r.status), json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return int(exc.code), json.loads(exc.read() or b"null")


def memory(body: dict[str, Any]) -> dict[str, Any]:
    """Graph memory as the server reports it, per rank: the pool's bytes and the resident outputs."""
    return {"pool_bytes": [r.get("pool_bytes") for r in body["ranks"]],
            "graph_pools_bytes": [r.get("graph_pools_bytes") for r in body["ranks"]],
            "resident_output_bytes": [r.get("resident_output_bytes") for r in body["ranks"]],
            "mode": body.get("mode")}


class Load:
    """``WORKERS`` threads, each posting one prompt at a time (greedy) until stopped."""

    def __init__(self, check: Any, base: str, prompts: list[list[int]]) -> None:
        self.check, self.base, self.prompts = check, base, prompts
        self.answers: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._work, args=(w,), daemon=True) for w in range(WORKERS)]

    def _work(self, worker: int) -> None:
        i = worker
        while not self._stop.is_set():
            k = i % len(self.prompts)
            t0 = time.time()
            try:
                ids = self.check.generate(self.base, self.prompts[k], NEW_TOKENS, REQUEST_S)["output_ids"]
                err = None
            except Exception as exc:  # noqa: BLE001 - a failed request is a finding
                ids, err = None, f"{type(exc).__name__}: {exc}"
            with self._lock:
                self.answers.append({"prompt": k, "ids": ids, "error": err, "t0": t0, "t1": time.time()})
            i += WORKERS

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(REQUEST_S + 10)


class Server:
    def __init__(self, check: Any, model: Path, mode: str, log: Path, incremental: bool = False) -> None:
        self.check, self.log = check, log
        self.launched, self.up_s = time.time(), 0.0
        port = check.free_port()
        self.base = f"http://127.0.0.1:{port}"
        cmd = check.server_command(str(model), port, mode, CHUNK[SHAPE], 0.3 if SHAPE == "tiny" else 0.5,
                                   131072, ["--admin-api-key", KEY])
        env = check.server_env(mode, os.environ["PLUGIN_SITE"])
        if incremental:
            env["SGLANG_BCG_INCREMENTAL_CAPTURE"] = "1"
        with log.open("wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env,
                                         cwd=tempfile.mkdtemp(prefix=f"sglang-switch-{mode}-"))  # no checkout on the path

    def __enter__(self) -> Server:
        try:
            self.check.wait_healthy(self.base, self.proc, START_S)
            self.up_s = round(time.time() - self.launched, 2)
        except Exception as exc:
            self.check.stop(self.proc)
            pytest.fail(f"server did not start ({exc}); its log {self.log}:\n{self.log.read_text(errors='replace')[-4000:]}")
        return self

    def __exit__(self, *exc: object) -> None:
        self.check.stop(self.proc)

    def start_figures(self, prompt: list[int]) -> dict[str, Any]:
        """Seconds from launch to /health and to the first answer."""
        ids = self.check.generate(self.base, prompt, NEW_TOKENS, REQUEST_S)["output_ids"]
        return {"up_s": self.up_s, "first_answer_s": round(time.time() - self.launched, 2), "first_ids": ids}

    def all_captured(self, timeout: float = 240.0, poll: float = 1.0) -> dict[str, Any]:
        """Wait until every rank has captured every prefill size (or a step failed, leaving the rest eager) and its
        decode graphs (no ``incremental``: at once); the last GET
        (every ``poll`` seconds: a GET reads the allocator's snapshot on the scheduler's thread)."""
        start = time.time()
        while True:
            body = admin(self.base)[1]
            states = [r.get("incremental") for r in body.get("ranks", [])]
            if all(s is None or ((s["captured"] == s["sizes"] or s["capture_failed"]) and not s["decode_pending"])
                   for s in states) or time.time() - start > timeout:
                return {"get": body, "waited_s": round(time.time() - start, 2),
                        "at_s": round(time.time() - self.launched, 2), "incremental": states}
            time.sleep(poll)

    def log_figures(self) -> dict[str, Any]:
        text = self.log.read_text(errors="replace")
        found = {k: v for k, v in self.check.parse_log(text).items() if k.endswith("_s") or k.endswith("_gb")}
        if m := ALL_CAPTURED.search(text):
            found["all_captured_after_first_s"] = float(m.group(2))
        if m := LARGEST.search(text):  # what the start-up captured before serving, by phase
            found["largest_capture_s"] = float(m.group(1))
            found["largest_phases_s"] = {k: float(v) for k, v in re.findall(r"([\w-]+) ([\d.]+) s", m.group(2))}
        return found


ALL_CAPTURED = re.compile(r"incremental capture: all (\d+) prefill sizes captured, ([\d.]+) s after the first")
LARGEST = re.compile(r"incremental capture: the largest prefill size \(\d+ tokens\) captured in ([\d.]+) s(?: \(([^)]*)\))?")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    check, make = load("server_check"), load("make_model")
    out = Path(os.environ.get("SGLANG_BCG_GPU_RESULTS_DIR", tmp_path_factory.mktemp("switch")))
    out.mkdir(parents=True, exist_ok=True)
    model = make.make_model(tmp_path_factory.mktemp("model") / SHAPE, **make.SHAPES[SHAPE])
    prompts = check.prompts(LENGTHS)
    found: dict[str, Any] = {"shape": SHAPE, "workers": WORKERS, "lengths": LENGTHS, "fresh": {}, "switches": [],
                             "incremental": INCREMENTAL, "first_minute_s": FIRST_MINUTE_S}
    path = out / ("sglang_switch_incremental.json" if INCREMENTAL else "sglang_switch.json")
    if resume := os.environ.get("SGLANG_BCG_SWITCH_RESUME"):  # an earlier call's references and start-up
        earlier = json.loads(Path(resume).read_text())
        found["fresh"] = {m: v for m, v in earlier["fresh"].items() if m in MODES}
        found.update({k: earlier[k] for k in ("startup",) if k in earlier})

    def save() -> None:
        path.write_text(json.dumps(found, indent=1) + "\n")

    # 1. references, captured first; ``on`` last, so that it and the start-up after it find the host warm (its
    # compile caches filled): the start-up figures compare two servers that started alike
    for mode in sorted((m for m in MODES if m not in found["fresh"] and "fresh" in PARTS), key=lambda m: m == "on"):
        with Server(check, model, mode, out / f"switch-fresh-{mode}.log") as srv:
            start = srv.start_figures(prompts[0])
            status, body = admin(srv.base)
            assert status == 200, f"fresh {mode}: GET /bcg/output_mode answered {status}: {body}"
            one = [check.generate(srv.base, p, NEW_TOKENS, REQUEST_S)["output_ids"] for p in prompts]
            with Load(check, srv.base, prompts) as traffic:
                time.sleep(FIRST_MINUTE_S if mode == "on" and FIRST_MINUTE_S else CONTROL_S)
            found["fresh"][mode] = {"get": body, "memory": memory(body), "one_at_a_time": one,
                                    "control": traffic.answers, "start": start}
        found["fresh"][mode]["start"].update(srv.log_figures())
        save()
    if INCREMENTAL and "startup" in PARTS and "startup" not in found:  # 2. start-up, idle: first answer, all sizes
        with Server(check, model, "on", out / "switch-startup.log", incremental=True) as srv:
            start = srv.start_figures(prompts[0])
            start.update(srv.all_captured())
        start.update(srv.log_figures())
        found["startup"] = start
        save()
    if "live" not in PARTS:
        pytest.skip(f"this call started {', '.join(PARTS)}; its JSON {path} is a later call's SGLANG_BCG_SWITCH_RESUME")
    with Server(check, model, "on", out / "switch-live.log", incremental=INCREMENTAL) as srv:  # 3. the switch
        found["live_start"] = srv.start_figures(prompts[0])
        with Load(check, srv.base, prompts) as traffic:
            if FIRST_MINUTE_S:  # the first minute's load, then every size captured
                found["first_minute"] = {"from": time.time(), "seconds": FIRST_MINUTE_S}
                time.sleep(FIRST_MINUTE_S)
                found["live_start"].update(srv.all_captured())
            found["initial"] = admin(srv.base)[1]
            time.sleep(SETTLE_S)
            for i, mode in enumerate(SEQUENCE):
                second: dict[str, Any] = {}

                def post_again(box: dict[str, Any] = second, target: str = mode) -> None:
                    time.sleep(0.05 if INCREMENTAL else 0.2)
                    box["sent"] = time.time()
                    # the same mode: should it land after the first ended, it changes nothing
                    box["status"], box["body"] = admin(srv.base, "POST", target, timeout=SWITCH_S)

                racer = threading.Thread(target=post_again, daemon=True) if i == 1 else None
                t0 = time.time()
                if racer is not None:
                    racer.start()
                status, body = admin(srv.base, "POST", mode, timeout=SWITCH_S)
                t1 = time.time()
                if racer is not None:
                    racer.join(REQUEST_S)
                again: dict[str, Any] = {}
                if racer is not None and INCREMENTAL:  # the switch answered; its sizes come between batches: a 409
                    again["sent"] = time.time()
                    again["status"], again["body"] = admin(srv.base, "POST", mode, timeout=SWITCH_S)
                captured = srv.all_captured()
                rest = (FIRST_MINUTE_S if i == 0 else 0.0) - (time.time() - t0)
                time.sleep(max(SETTLE_S, rest))
                after = admin(srv.base)[1]
                found["switches"].append({"mode": mode, "status": status, "body": body, "t0": t0, "t1": t1,
                                          "wall_s": round(t1 - t0, 3), "after": after, "memory": memory(after),
                                          "second": second or None, "after_answer": again or None,
                                          "captured_at": captured["at_s"] + srv.launched,
                                          "incremental": captured["incremental"]})
                print(f"switch to {mode}: {status} in {body.get('seconds')} s ({body.get('phases')}); every size "
                      f"{round(captured['at_s'] + srv.launched - t0, 2)} s after the POST; {json.dumps(memory(after))}",
                      flush=True)
                save()
        found["answers"] = traffic.answers
    found["live_start"].update(srv.log_figures())
    save()
    return found


def _reference(results: dict[str, Any]) -> list[list[int]]:
    return list(results["fresh"]["on"]["one_at_a_time"])


def test_references_agree_across_modes(results: dict[str, Any]) -> None:
    ref = _reference(results)
    for mode in MODES:
        assert results["fresh"][mode]["one_at_a_time"] == ref, f"a fresh {mode} server answers differently from on"


def test_every_switch_answers_in_the_mode_asked_with_its_time(results: dict[str, Any]) -> None:
    assert [s["mode"] for s in results["switches"]] == list(SEQUENCE)
    for s in results["switches"]:
        assert s["status"] == 200, f"switch to {s['mode']}: {s['status']} {s['body']}"
        assert s["body"]["mode"] == s["mode"] and s["after"]["mode"] == s["mode"], s
        assert isinstance(s["body"]["seconds"], float) and 0 < s["body"]["seconds"] <= s["wall_s"] + 1, s


def test_a_second_switch_while_one_runs_is_refused(results: dict[str, Any]) -> None:
    raced = results["switches"][1]
    second = raced["second"]
    assert second and second.get("status") is not None, raced
    if second["sent"] >= raced["t1"]:
        pytest.skip(f"the switch to {raced['mode']} took {raced['wall_s']} s: over before the second POST")
    assert second["status"] == 409 and "is running" in second["body"]["error"], second


def test_with_incremental_capture_a_switch_runs_until_its_sizes_are_captured(results: dict[str, Any]) -> None:
    """A POST after the switch answered, while its sizes are still captured between batches: 409, nothing touched."""
    needs_incremental(results)
    raced = results["switches"][1]
    again = raced.get("after_answer")
    if again is None:
        pytest.skip("no POST after the switch's answer in this run (recorded before it was sent)")
    if again["sent"] >= raced["captured_at"]:
        pytest.skip(f"every size was captured before the POST after the answer ({raced['captured_at'] - raced['t1']:.1f} s)")
    assert again["status"] == 409 and "is running: its graphs are being captured between batches" in (
        again["body"]["error"]), again


def test_no_request_is_lost_or_answered_wrong(results: dict[str, Any]) -> None:
    ref = _reference(results)
    allowed: dict[int, set[tuple[int, ...]]] = {k: {tuple(ids)} for k, ids in enumerate(ref)}
    control = 0
    for mode in MODES:
        for a in results["fresh"][mode]["control"]:
            if a["ids"] is not None:
                allowed[a["prompt"]].add(tuple(a["ids"]))
                control += tuple(a["ids"]) != tuple(ref[a["prompt"]])
    answers = results["answers"]
    failed = [a for a in answers if a["error"] is not None]
    assert not failed, f"{len(failed)} of {len(answers)} requests failed: {failed[:3]}"
    wrong = [a for a in answers if tuple(a["ids"]) not in allowed[a["prompt"]]]
    first, last = results["switches"][0]["t0"], results["switches"][-1]["t1"]
    during = sum(a["t0"] <= last and a["t1"] >= first for a in answers)
    assert during > 0, "no request was in flight while the switches ran"
    assert not wrong, (f"{len(wrong)} of {len(answers)} answers differ from every fresh server's "
                       f"(fresh servers under the same load differed from one-at-a-time in {control}): {wrong[:3]}")


def test_graph_memory_after_each_switch_equals_a_fresh_servers(results: dict[str, Any]) -> None:
    """After each switch the graph pool is no larger than a fresh server's in that mode (±2 MiB; a pool under it is
    printed: with incremental capture the 8B shapes' ``off`` pool came out 28-42 MiB under, docs/benchmarks.md), and
    the resident outputs equal a fresh server's."""
    rows = []
    for s in results["switches"]:
        fresh = results["fresh"][s["mode"]]["memory"]
        for what in ("pool_bytes", "graph_pools_bytes", "resident_output_bytes"):
            for rank, (got, want) in enumerate(zip(s["memory"][what], fresh[what])):
                rows.append((s["mode"], what, rank, got, want))
    over = [r for r in rows if r[3] is None or r[4] is None or r[3] - r[4] > TOLERANCE
            or (r[1] == "resident_output_bytes" and abs(r[3] - r[4]) > TOLERANCE)]
    assert rows and not over, "after switch vs fresh (mode, figure, rank, after, fresh): " + "; ".join(
        f"{m} {w} rank {k}: {g} vs {f}" for m, w, k, g, f in over)
    for m, w, k, g, f in rows:
        if w == "pool_bytes" and f - g > TOLERANCE:
            print(f"after the switch to {m}: rank {k}'s graph pool {(f - g) / MIB:.0f} MiB under a fresh server's "
                  f"({g} vs {f} bytes)", flush=True)


def outside_allocator(rank: dict[str, Any]) -> int:
    """Device memory the process holds outside PyTorch's allocator: the CUDA driver's (the graphs
    instantiated, the context), read as total - free - reserved (the server is alone on the GPU)."""
    return int(rank["total_bytes"]) - int(rank["free_bytes"]) - int(rank["reserved_bytes"])


def test_the_old_graphs_driver_memory_is_freed(results: dict[str, Any]) -> None:
    """What the driver holds for graphs after each switch equals a fresh server's in that mode
    (old graphs not destroyed would show here, beside an exact pool)."""
    bad = []
    for s in results["switches"]:
        fresh = [outside_allocator(r) for r in results["fresh"][s["mode"]]["get"]["ranks"]]
        after = [outside_allocator(r) for r in s["after"]["ranks"]]
        assert len(after) == len(fresh), s
        bad += [(s["mode"], k, a, f) for k, (a, f) in enumerate(zip(after, fresh)) if abs(a - f) > TOLERANCE]
    assert not bad, "outside the allocator after switch vs fresh (mode, rank, after, fresh): " + "; ".join(map(str, bad))


def _latency_p99(answers: list[dict[str, Any]]) -> float:
    lat = sorted(a["t1"] - a["t0"] for a in answers if a["error"] is None)
    return lat[min(len(lat) - 1, int(0.99 * len(lat)))]


def served(results: dict[str, Any], answers: list[dict[str, Any]], lo: float, hi: float) -> dict[str, float]:
    """Answers ended in ``[lo, hi]``: per second, and their tokens (prompt and new) per second."""
    done = [a for a in answers if a["error"] is None and lo <= a["t1"] <= hi]
    tokens = sum(results["lengths"][a["prompt"]] + NEW_TOKENS for a in done)
    return {"answers_per_s": round(len(done) / (hi - lo), 2), "tokens_per_s": round(tokens / (hi - lo), 1)}


def throughput(results: dict[str, Any]) -> dict[str, Any]:
    """The first minute from the first answer, and after the first switch, against the fresh ``on`` server (every
    size captured first, never switched) under the same load."""
    control = results["fresh"]["on"]["control"]
    lo = min(a["t0"] for a in control)
    first = results["first_minute"]
    switch = results["switches"][0]
    window = min(results["first_minute_s"], results["switches"][1]["t0"] - switch["t0"])
    return {"captured_first": served(results, control, lo, lo + results["first_minute_s"]),
            "first_minute": served(results, results["answers"], first["from"], first["from"] + first["seconds"]),
            "after_switch": served(results, results["answers"], switch["t0"], switch["t0"] + window),
            "after_switch_s": round(window, 1)}


def needs_incremental(results: dict[str, Any]) -> None:
    if not results.get("incremental"):
        pytest.skip("the switched server captured every size at once (SGLANG_BCG_SWITCH_INCREMENTAL=1 for these)")


def test_no_answer_overlapping_a_switch_waits_for_the_whole_recapture(results: dict[str, Any]) -> None:
    """The longest answer overlapping a switch or its later captures: at most 3 x the idle p99 latency (the fresh
    ``on`` server, same load) plus the slowest capture of one size that switch made."""
    needs_incremental(results)
    p99, rows = _latency_p99(results["fresh"]["on"]["control"]), []
    for s in results["switches"]:
        overlapping = [a["t1"] - a["t0"] for a in results["answers"] if a["t0"] <= s["captured_at"] and a["t1"] >= s["t0"]]
        one_size = max(r["slowest_step_per_size_s"] for r in s["incremental"])
        rows.append((s["mode"], round(max(overlapping), 3), round(3 * p99 + one_size, 3), len(overlapping)))
    print(f"idle p99 {p99:.3f} s; (mode, longest overlapping, bound, answers overlapping): {rows}", flush=True)
    assert all(n > 0 and longest <= bound for _, longest, bound, n in rows), rows


def start_to_answer(start: dict[str, Any]) -> float:
    """Seconds from the scheduler's start (SGLang's ``scheduler_e2e``: weights, KV pool, captures) to the first
    answer, where the log has it (else from launch): launching Python and importing SGLang, the same code for
    every server, varied by 5 s from one server to the next on one host (docs/benchmarks.md)."""
    if "scheduler_s" not in start:
        return float(start["first_answer_s"])
    return float(start["scheduler_s"]) + float(start["first_answer_s"]) - float(start["up_s"])


def test_startup_answers_first_and_captures_every_size_in_time(results: dict[str, Any]) -> None:
    """Idle start-up with incremental capture against the fresh ``on`` server (every size captured first), on the 8B
    shapes (the issue's criterion): the first answer earlier by 90 % of that server's prefill capture; every size
    within 1.2 x that capture. On the tiny model, whose whole capture (5 s) is little more than what its first size
    and the decode graphs take, the figures are printed and the check skipped."""
    needs_incremental(results)
    if "startup" not in results:
        pytest.skip("no start-up server in this run (SGLANG_BCG_SWITCH_PARTS without startup)")
    ref, inc = results["fresh"]["on"]["start"], results["startup"]
    capture = ref["prefill_capture_s"]
    earlier, wall = start_to_answer(ref) - start_to_answer(inc), ref["first_answer_s"] - inc["first_answer_s"]
    print(f"first answer {earlier:.2f} s earlier from the scheduler's start ({wall:.2f} s from launch: "
          f"{inc['first_answer_s']} s vs {ref['first_answer_s']} s), bound 0.9 x {capture} s; every size "
          f"{inc.get('all_captured_after_first_s')} s after the first, bound 1.2 x {capture} s", flush=True)
    if results["shape"] == "tiny":
        pytest.skip(f"tiny: the criterion is the 8B shapes' (first answer {earlier:.2f} s earlier, capture {capture} s)")
    assert earlier >= 0.9 * capture, (inc, ref)
    assert inc["all_captured_after_first_s"] <= 1.2 * capture, (inc, ref)


def test_graph_memory_once_every_size_is_captured_equals_a_server_that_captured_them_first(results: dict[str, Any]) -> None:
    needs_incremental(results)
    fresh = results["fresh"]["on"]
    parts = [("start-up", results["startup"]["get"])] if "startup" in results else []
    for name, body in (*parts, ("switched server's start", results["initial"])):
        got = memory(body)
        bad = [(what, g, f) for what in ("pool_bytes", "graph_pools_bytes", "resident_output_bytes")
               for g, f in zip(got[what], fresh["memory"][what]) if g is None or abs(g - f) > TOLERANCE]
        bad += [("outside the allocator", outside_allocator(g), outside_allocator(f))
                for g, f in zip(body["ranks"], fresh["get"]["ranks"])
                if abs(outside_allocator(g) - outside_allocator(f)) > TOLERANCE]
        assert not bad, f"{name} vs fresh on (figure, incremental, fresh): {bad}"


def test_throughput_first_minute_and_after_a_switch(results: dict[str, Any]) -> None:
    """Reported (docs/benchmarks.md): answers and tokens per second; the load was served in every window."""
    needs_incremental(results)
    found = throughput(results)
    print("throughput: " + json.dumps(found), flush=True)
    assert all(v["answers_per_s"] > 0 for k, v in found.items() if isinstance(v, dict)), found


def summary(results: dict[str, Any]) -> dict[str, Any]:
    """The figures docs/benchmarks.md reports, from a results JSON (``python THIS_FILE RESULTS.json``)."""
    p99 = _latency_p99(results["fresh"]["on"]["control"])
    rows = []
    for s in results["switches"]:
        overlapping = [a["t1"] - a["t0"] for a in results["answers"] if a["t0"] <= s["captured_at"] and a["t1"] >= s["t0"]]
        one_size = max((r or {}).get("slowest_step_per_size_s", 0.0) for r in s.get("incremental") or [{}])
        phases = [dict(r.get("phases") or {}, **(r.get("drop_parts") or {})) for r in s["body"].get("ranks") or [{}]]
        rows.append({"mode": s["mode"], "answer_s": s["body"].get("seconds"), "phases": phases,
                     "all_captured_after_post_s": round(s["captured_at"] - s["t0"], 2),
                     "longest_overlapping_s": round(max(overlapping), 3), "overlapping": len(overlapping),
                     "bound_s": round(3 * p99 + one_size, 3)})
    out: dict[str, Any] = {"shape": results["shape"], "idle_p99_s": round(p99, 4), "switches": rows,
                           "fresh_on_start": results["fresh"]["on"].get("start"), "startup": results.get("startup"),
                           "live_start": results.get("live_start")}
    for key in ("startup", "live_start"):
        if isinstance(out[key], dict):
            out[key] = {k: v for k, v in out[key].items() if k not in ("get", "first_ids")}
    if results.get("incremental"):
        out["throughput"] = throughput(results)
    return out


if __name__ == "__main__":
    import sys

    print(json.dumps(summary(json.loads(Path(sys.argv[1]).read_text())), indent=1))
