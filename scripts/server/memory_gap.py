"""The memory a real SGLang server leaves idle: what it sizes for itself, what it uses at its peak.

    python scripts/server/memory_gap.py --model DIR --variants stock,post-capture --out-dir OUT
    python scripts/server/memory_gap.py --summarize OUT        # the table again, from OUT's JSON

One server at a time per variant (device memory is read from the whole card, so never two at
once), each ``python -m sglang.launch_server`` on a ``make_model.py`` directory (``--shape
llama3-8b``: Llama-3-8B's shapes, dummy weights) with ``server_check.py``'s options except the
ones SGLang sizes itself: no ``--mem-fraction-static``, no ``--max-total-tokens``, no
``--chunked-prefill-size`` and no decode batch size unless asked (``--chunked-prefill-size``,
``--cuda-graph-max-bs-decode``), so the chunk, the decode graphs' largest batch and the static
fraction are SGLang's defaults for the card. Variants:

* ``stock``: the plugin not importable, SGLang sizing itself (``memory_hook.py``'s reserve);
* ``post-capture``: stock with ``SGLANG_ENABLE_POST_CAPTURE_KV_SIZING=1`` (the KV pool reserved as
  virtual memory, backed after capture with what is free);
* ``plugin-on``: the plugin installed (``--plugin-path``) and ``--enable-bcg-shared-output``.

Per variant, with device memory sampled all along (``nvidia-smi ... -lms 100`` read by a thread
that stamps each line, or NVML where ``nvidia-smi`` is missing): ``/health``; greedy output ids
on a few fixed prompts (compared across variants); then the adversarial load, every request sent
at once from its own thread behind one barrier and run to completion: prompts of the full chunk,
requests with ``return_logprob`` and ``logprob_start_len=0`` over whole long prompts (logits for
every token), and a full decode batch (SGLang's decode graph batch for the card) of long
generations with ``ignore_eos``. Then the server is stopped and its log read: the static fraction
it chose (its ``server_args=`` line), the weights' load line, the KV pool's tokens and size, each
capture's ``mem usage``/``avail mem``, the post-capture resize, the scheduler's
``max_total_num_tokens`` and free memory after capture, the largest decode batch it ran, and any
out-of-memory line. Writes ``OUT/memory-gap-VARIANT.json`` (with the server log and the samples
beside it) and prints a summary table: fraction, KV tokens, free after capture, peak used during
the load, unused at the peak (total minus peak used), failed requests, OOM.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:  # a script beside server_check.py, also when loaded by path
    sys.path.insert(0, str(_HERE))
import server_check

#: Variant -> (server_check's variant: the plugin's presence and flag, env set on top of it).
VARIANTS: dict[str, tuple[str, dict[str, str]]] = {
    "stock": ("stock", {}),
    "post-capture": ("stock", {"SGLANG_ENABLE_POST_CAPTURE_KV_SIZING": "1"}),
    "plugin-on": ("on", {}),
    # the memory plan (sglang_bcg_plugin/sglang/memory_plan.py) with the shared output, and with SGLang's mode
    "plan": ("on", {"SGLANG_BCG_MEMORY_PLAN": "1"}),
    "plan-off": ("off", {"SGLANG_BCG_MEMORY_PLAN": "1"}),
}
#: server_check's options that this measurement leaves to SGLang (and re-adds only when asked).
SIZED_BY_SGLANG = ("--mem-fraction-static", "--max-total-tokens", "--chunked-prefill-size",
                   "--cuda-graph-max-bs-decode", "--cuda-graph-max-bs")
#: Ids below this bound are tokens make_model's tokenizer knows (server_check.prompts' default).
ID_BOUND = 380
GREEDY_LENGTHS = (5, 200, 1500, 3000)
MIB = 1 << 20
GIB = 1 << 30

# --- SGLang 0.5.23's log lines (their format strings: tests/test_memory_gap.py) -------------------
_NUM = r"([\d.]+)"
_SERVER_ARGS = re.compile(r"server_args=(\{.*\})\s*$", re.MULTILINE)
_LOAD_BEGIN = re.compile(r"Load weight begin\. avail mem=" + _NUM + " GB")
_LOAD_END = re.compile(r"Load weight end\. elapsed=" + _NUM + r" s, type=(\w+), .*?avail mem=" + _NUM
                       + r" GB, mem usage=" + _NUM + " GB")
_KV_ALLOC = re.compile(r"KV Cache (is allocated|VA upper bound)\. dtype: (\S+), #tokens: (\d+), "
                       r"(?:K size: " + _NUM + r" GB, V size: " + _NUM + r" GB|KV size: " + _NUM + " GB)")
_POOL_END = re.compile(r"Memory pool end\. avail mem=" + _NUM + " GB")
_CAPTURE_BEGIN = re.compile(r"Capture (\w+) (\w+) \w+ graph begin\. backend=([\w.]+), "
                            r".*?avail mem=" + _NUM + " GB")
_CAPTURE_END = re.compile(r"Capture (\w+) (\w+) \w+ graph end\. (?:bs=\[([\d, ]*)\], )?"
                          r"elapsed=" + _NUM + " s, mem usage=" + _NUM + " GB, avail mem=" + _NUM + " GB")
_POST_CAPTURE = re.compile(r"Post-capture KV sizing: KV cache allocated\. dtype: (\S+), #tokens: (\d+), "
                           r"KV size: " + _NUM + " GB, avail mem=" + _NUM + " GB")
_POST_CAPTURE_REQS = re.compile(r"Post-capture KV sizing: max_running_requests (\d+) -> (\d+)")
_POST_CAPTURE_GAP = re.compile(r"Post-capture KV sizing: decode CUDA graph max_bs=(\d+) < max_running_requests=(\d+); "
                               r"reserving activation headroom")
_SCHEDULER = re.compile(r"max_total_num_tokens=(\d+), chunked_prefill_size=(-?\d+), max_prefill_tokens=(\d+), "
                        r"max_running_requests=(\d+), context_len=(\d+), available_gpu_mem=" + _NUM + " GB")
_DECODE_BATCH = re.compile(r"Decode batch(?: \[\d+\])?, #running-req: (\d+), .*?\w+ graph: (True|False)")
_PREFILL_BATCH = re.compile(r"Prefill batch(?: \[\d+\])?, #new-seq: (\d+), #new-token: (\d+), ")
_PLAN = re.compile(r"sglang_bcg: memory plan: card .*? \+ eager " + _NUM + r" GiB .*? \+ margin " + _NUM
                   + r" GiB \+ KV " + _NUM + r" GiB(?: = (\d+) tokens)?")
_PLAN_AFTER = re.compile(r"sglang_bcg: memory plan: KV backed (\d+) tokens .*?planned peak " + _NUM + " GiB")
_PLAN_NOT = re.compile(r"sglang_bcg: memory plan: not applied: .*")
_OOM = re.compile(r"out of memory|OutOfMemoryError|CUDA error", re.IGNORECASE)


def without_options(cmd: list[str], names: tuple[str, ...]) -> list[str]:
    """``cmd`` without each ``--name value`` / ``--name=value`` pair named in ``names``."""
    out: list[str] = []
    skip = False
    for word in cmd:
        if skip:
            skip = False
        elif word in names:
            skip = True
        elif not word.startswith("--") or word.split("=", 1)[0] not in names:
            out.append(word)
    return out


def server_command(model: str, port: int, variant: str, chunk: int | None = None,
                   decode_max_bs: int | None = None, extra: list[str] | None = None) -> list[str]:
    """server_check's command for ``variant`` with the sizes SGLang chooses left to it, plus the
    chunk and the decode graphs' largest batch where given."""
    check_variant = VARIANTS[variant][0]
    cmd = without_options(server_check.server_command(model, port, check_variant, 0, 0.0, 0, []), SIZED_BY_SGLANG)
    if chunk is not None:
        cmd += ["--chunked-prefill-size", str(chunk)]
    if decode_max_bs is not None:
        # the installed release's name for it (0.5.13: one --cuda-graph-max-bs)
        flags = server_check.release_flags()
        cmd += [next((f for f in SIZED_BY_SGLANG[3:] if f in flags), SIZED_BY_SGLANG[3]), str(decode_max_bs)]
    return cmd + list(extra or [])


def variant_env(variant: str, plugin_path: str | None) -> dict[str, str]:
    check_variant, extra = VARIANTS[variant]
    if check_variant != "stock" and not plugin_path:
        msg = f"variant {variant!r} needs the plugin: pass --plugin-path (setup.sh exports PLUGIN_SITE)"
        raise ValueError(msg)
    env = server_check.server_env(check_variant, plugin_path)
    env.pop("SGLANG_ENABLE_POST_CAPTURE_KV_SIZING", None)  # only the variant that asks for it
    env.update(extra)
    return env


# --- the log ----------------------------------------------------------------------------------------
def parse_server_args(text: str) -> dict[str, Any]:
    """The resolved sizes from the launcher's last ``server_args={...}`` line (a dict literal)."""
    found = _SERVER_ARGS.findall(text)
    if not found:
        return {}
    literal = found[-1]
    try:
        args = ast.literal_eval(literal)
    except (ValueError, SyntaxError):
        args = None
    if isinstance(args, dict):
        graphs = args.get("cuda_graph_config") or {}
        decode, prefill = graphs.get("decode") or {}, graphs.get("prefill") or {}
        return {"mem_fraction_static": args.get("mem_fraction_static"),
                "chunked_prefill_size": args.get("chunked_prefill_size"),
                "max_running_requests": args.get("max_running_requests"),
                "max_total_tokens": args.get("max_total_tokens"),
                "decode_backend": decode.get("backend"), "decode_max_bs": decode.get("max_bs"),
                "decode_sizes": len(decode.get("bs") or []),
                "prefill_backend": prefill.get("backend"), "prefill_max_bs": prefill.get("max_bs"),
                "prefill_sizes": len(prefill.get("bs") or [])}
    # not a literal (a value without one): the fields this measurement needs, one by one
    out: dict[str, Any] = {}
    for name in ("mem_fraction_static", "chunked_prefill_size"):
        if m := re.search(rf"'{name}': (-?[\d.]+)", literal):
            out[name] = float(m.group(1)) if "." in m.group(1) else int(m.group(1))
    if m := re.search(r"'decode': \{'backend': '(\w+)', 'max_bs': (\d+)", literal):
        out["decode_backend"], out["decode_max_bs"] = m.group(1), int(m.group(2))
    return out


def parse_memory_log(text: str) -> dict[str, Any]:
    """SGLang's memory lines, as numbers (SGLang's "GB" is GiB: it divides by 1 << 30)."""
    found: dict[str, Any] = {"server_args": parse_server_args(text)}
    if m := _LOAD_BEGIN.search(text):
        found["load_begin_avail_gib"] = float(m.group(1))
    if m := _LOAD_END.search(text):
        found["weights"] = {"elapsed_s": float(m.group(1)), "type": m.group(2),
                            "avail_gib": float(m.group(3)), "usage_gib": float(m.group(4))}
    if m := _KV_ALLOC.search(text):
        k, v, kv = (float(x) if x else 0.0 for x in m.group(4, 5, 6))
        found["kv_pool"] = {"virtual": m.group(1) == "VA upper bound", "dtype": m.group(2),
                            "tokens": int(m.group(3)), "size_gib": kv if m.group(6) else round(k + v, 2)}
    if m := _POOL_END.search(text):
        found["pool_end_avail_gib"] = float(m.group(1))
    begins = {(b.group(1), b.group(2)): (b.group(3), float(b.group(4))) for b in _CAPTURE_BEGIN.finditer(text)}
    captures = []
    for e in _CAPTURE_END.finditer(text):
        backend, before = begins.get((e.group(1), e.group(2)), (None, None))
        bs = [int(x) for x in e.group(3).split(",") if x.strip()] if e.group(3) else None
        captures.append({"role": e.group(1), "phase": e.group(2), "backend": backend, "avail_before_gib": before,
                         "elapsed_s": float(e.group(4)), "mem_usage_gib": float(e.group(5)),
                         "avail_after_gib": float(e.group(6)), "sizes": len(bs) if bs else None,
                         "max_bs": max(bs) if bs else None})
    found["captures"] = captures
    if m := _POST_CAPTURE.search(text):
        found["post_capture"] = {"tokens": int(m.group(2)), "size_gib": float(m.group(3)),
                                 "avail_gib": float(m.group(4))}
        if r := _POST_CAPTURE_REQS.search(text):
            found["post_capture"]["max_running_requests"] = [int(r.group(1)), int(r.group(2))]
        if g := _POST_CAPTURE_GAP.search(text):  # its headroom is then the stock activation reserve
            found["post_capture"]["eager_decode_gap"] = {"decode_max_bs": int(g.group(1)),
                                                         "max_running_requests": int(g.group(2))}
    if m := _PLAN.search(text):
        found["plan"] = {"eager_gib": float(m.group(1)), "margin_gib": float(m.group(2)), "kv_gib": float(m.group(3)),
                         "kv_tokens": int(m.group(4)) if m.group(4) else None, "line": m.group(0)}
        if a := _PLAN_AFTER.search(text):
            found["plan"].update(backed_tokens=int(a.group(1)), planned_peak_gib=float(a.group(2)))
    if m := _PLAN_NOT.search(text):
        found["plan"] = {"not_applied": m.group(0)}
    if m := _SCHEDULER.search(text):
        found["scheduler"] = {"max_total_num_tokens": int(m.group(1)), "chunked_prefill_size": int(m.group(2)),
                              "max_prefill_tokens": int(m.group(3)), "max_running_requests": int(m.group(4)),
                              "context_len": int(m.group(5)), "available_gpu_mem_gib": float(m.group(6))}
    decode = [(int(n), graph == "True") for n, graph in _DECODE_BATCH.findall(text)]
    found["decode_batches"] = {"logged": len(decode), "max_running": max((n for n, _ in decode), default=0),
                               "eager": sum(1 for _, graph in decode if not graph)}
    found["prefill_max_new_tokens"] = max((int(t) for _, t in _PREFILL_BATCH.findall(text)), default=0)
    found["oom_lines"] = [line.strip()[:300] for line in text.splitlines() if _OOM.search(line)][:10]
    return found


def kv_tokens(log: dict[str, Any]) -> int | None:
    """The tokens the KV pool serves: the scheduler's (after any post-capture resize), else the
    post-capture line's, else the pool's allocation line's."""
    for key, field in (("scheduler", "max_total_num_tokens"), ("post_capture", "tokens"), ("kv_pool", "tokens")):
        if key in log:
            return int(log[key][field])
    return None


def free_after_capture_gib(log: dict[str, Any]) -> float | None:
    """Free device memory once the server is ready: the scheduler's figure (after capture and any
    post-capture resize), else the post-capture line's, else the last capture's."""
    if "scheduler" in log:
        return float(log["scheduler"]["available_gpu_mem_gib"])
    if "post_capture" in log:
        return float(log["post_capture"]["avail_gib"])
    if log.get("captures"):
        return float(log["captures"][-1]["avail_after_gib"])
    return None


def kv_bytes_per_token(config: dict[str, Any], dtype_bytes: int = 2) -> int:
    """A Llama's KV cache bytes per token: K and V, every layer, every KV head (bf16 by default)."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * int(config["num_hidden_layers"]) * int(config["num_key_value_heads"]) * int(head_dim) * dtype_bytes


# --- device memory ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sample:
    t: float
    used_mib: float
    total_mib: float


def parse_smi_line(line: str) -> tuple[float, float] | None:
    """``used, total`` (MiB) from one ``nvidia-smi --query-gpu=memory.used,memory.total
    --format=csv,noheader,nounits`` line; ``None`` for anything else ([N/A], a message)."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 2:
        return None
    try:
        used, total = float(parts[0]), float(parts[1])
    except ValueError:
        return None
    return (used, total) if total > 0 and 0 <= used <= total else None


def parse_samples(text: str) -> list[Sample]:
    """The sampler's file: one ``TIME USED_MIB TOTAL_MIB`` line per sample."""
    samples = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 3:
            try:
                samples.append(Sample(float(parts[0]), float(parts[1]), float(parts[2])))
            except ValueError:
                continue
    return samples


def peak(samples: list[Sample], start: float, end: float) -> Sample | None:
    """The sample of most memory used within ``[start, end]`` (the first such), or ``None``."""
    inside = [s for s in samples if start <= s.t <= end]
    return max(inside, key=lambda s: s.used_mib) if inside else None


def memory_summary(samples: list[Sample], marks: dict[str, float]) -> dict[str, Any]:
    """Device memory over the run: used before the server started, idle once it served, the peak
    during the load (and over the whole run), the card's total, and what the peak left unused."""
    if not samples:
        return {"samples": 0}
    total = max(s.total_mib for s in samples)
    out: dict[str, Any] = {"samples": len(samples), "total_mib": total}
    before = [s for s in samples if s.t < marks.get("start", float("inf"))]
    if before:
        out["before_start_used_mib"] = before[-1].used_mib
    idle = [s for s in samples if marks.get("healthy", float("inf")) <= s.t <= marks.get("load_start", float("-inf"))]
    if idle:
        out["idle_used_mib"] = idle[-1].used_mib
    if "load_start" in marks and "load_end" in marks:
        top = peak(samples, marks["load_start"], marks["load_end"])
        out["load_samples"] = len([s for s in samples if marks["load_start"] <= s.t <= marks["load_end"]])
        if top is not None:
            out["peak_used_mib"] = top.used_mib
            out["peak_at_s"] = round(top.t - marks["load_start"], 2)
            out["unused_at_peak_mib"] = total - top.used_mib
    run_top = peak(samples, marks.get("start", samples[0].t), marks.get("stop", samples[-1].t))
    if run_top is not None:
        out["run_peak_used_mib"] = run_top.used_mib
    return out


class MemorySampler:
    """Device memory used, sampled every ``interval_ms`` into ``path`` (``TIME USED TOTAL`` in MiB):
    ``nvidia-smi -lms`` read line by line by a thread that stamps each line, or NVML polled."""

    def __init__(self, path: Path, interval_ms: int = 100, gpu: int = 0, source: str = "auto") -> None:
        if source == "auto":
            source = "nvidia-smi" if shutil.which("nvidia-smi") else "pynvml"
        self.path, self.interval_ms, self.gpu, self.source = path, interval_ms, gpu, source
        self._proc: subprocess.Popen[str] | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self) -> MemorySampler:
        out = self.path.open("w")
        if self.source == "nvidia-smi":
            self._proc = subprocess.Popen(
                ["nvidia-smi", "-i", str(self.gpu), "--query-gpu=memory.used,memory.total",
                 "--format=csv,noheader,nounits", "-lms", str(self.interval_ms)],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self._thread = threading.Thread(target=self._read_smi, args=(self._proc, out), daemon=True)
        elif self.source == "pynvml":
            if importlib.util.find_spec("pynvml") is None:
                out.close()
                msg = "no nvidia-smi on PATH and no pynvml (nvidia-ml-py) to read device memory with"
                raise RuntimeError(msg)
            self._thread = threading.Thread(target=self._poll_nvml, args=(out,), daemon=True)
        else:
            out.close()
            msg = f"unknown sampler {self.source!r}: expected auto, nvidia-smi or pynvml"
            raise ValueError(msg)
        self._thread.start()
        return self

    @staticmethod
    def _read_smi(proc: subprocess.Popen[str], out: TextIO) -> None:
        with out:
            assert proc.stdout is not None
            for line in proc.stdout:
                now = time.time()
                if parsed := parse_smi_line(line):
                    out.write(f"{now:.3f} {parsed[0]:.0f} {parsed[1]:.0f}\n")
                    out.flush()

    def _poll_nvml(self, out: TextIO) -> None:
        import pynvml  # nvidia-ml-py: in the server bundle's wheels

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(self.gpu)
            with out:
                while not self._stop.is_set():
                    info = pynvml.nvmlDeviceGetMemoryInfo(handle)
                    out.write(f"{time.time():.3f} {info.used / MIB:.0f} {info.total / MIB:.0f}\n")
                    out.flush()
                    self._stop.wait(self.interval_ms / 1000)
        finally:
            pynvml.nvmlShutdown()

    def used_mib(self) -> float | None:
        """The latest sample's memory used."""
        samples = parse_samples(self.path.read_text()) if self.path.exists() else []
        return samples[-1].used_mib if samples else None

    def stop(self) -> None:
        self._stop.set()
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._proc is not None and self._proc.stdout is not None:
            self._proc.stdout.close()


# --- the load ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoadRequest:
    """One request of the load: ``kind`` is ``chunk``, ``logprob`` or ``decode``."""

    kind: str
    prompt_len: int
    new_tokens: int
    body: dict[str, Any]


@dataclass(frozen=True)
class LoadShape:
    """How many requests of each kind, their prompt lengths and new tokens."""

    chunk: int
    decode_batch: int
    chunk_prompts: int = 4
    chunk_new_tokens: int = 16
    logprob_prompts: int = 2
    logprob_tokens: int = 16384
    logprob_new_tokens: int = 8
    decode_prompt_tokens: int = 512
    new_tokens: int = 256

    def check(self, context_len: int | None = None) -> None:
        for name, value in vars(self).items():
            if value < 0 or (value == 0 and name in ("chunk", "decode_batch", "new_tokens")):
                msg = f"load: {name} must be {'positive' if value == 0 else 'at least 0'}, got {value}"
                raise ValueError(msg)
        if context_len is None:
            return
        for name, prompt, new in (("chunk prompt", self.chunk, self.chunk_new_tokens),
                                  ("logprob prompt", self.logprob_tokens, self.logprob_new_tokens),
                                  ("decode prompt", self.decode_prompt_tokens, self.new_tokens)):
            if prompt + new > context_len:
                msg = (f"load: a {name} of {prompt} tokens plus {new} new ones is over the server's context "
                       f"of {context_len} tokens; pass a shorter one")
                raise ValueError(msg)


def build_load(shape: LoadShape, vocab: int = ID_BOUND) -> list[LoadRequest]:
    """The adversarial load: the decode batch, the full-chunk prompts, the logprob requests; every
    prompt distinct, every id below ``vocab``, greedy, ``ignore_eos`` (each runs to its length)."""
    shape.check()
    kinds = ([("decode", shape.decode_prompt_tokens, shape.new_tokens)] * shape.decode_batch
             + [("chunk", shape.chunk, shape.chunk_new_tokens)] * shape.chunk_prompts
             + [("logprob", shape.logprob_tokens, shape.logprob_new_tokens)] * shape.logprob_prompts)
    ids = server_check.prompts(tuple(n for _, n, _ in kinds), vocab)
    out = []
    for (kind, n, new), prompt in zip(kinds, ids, strict=True):
        body: dict[str, Any] = {"input_ids": prompt,
                                "sampling_params": {"temperature": 0.0, "max_new_tokens": new, "ignore_eos": True}}
        if kind == "logprob":
            body.update(return_logprob=True, logprob_start_len=0)
        out.append(LoadRequest(kind, n, new, body))
    return out


def check_reply(req: LoadRequest, reply: Any) -> str | None:
    """Why ``reply`` is a failed request, or ``None``: an error, an abort, fewer output ids than
    asked (``ignore_eos``), or input logprobs not covering the whole prompt."""
    if not isinstance(reply, dict):
        return f"the answer is a {type(reply).__name__}, not a JSON object"
    if "error" in reply or reply.get("object") == "error":
        return f"error in the answer: {str(reply.get('error') or reply.get('message'))[:300]}"
    meta = reply.get("meta_info") or {}
    reason = meta.get("finish_reason")
    if isinstance(reason, dict) and reason.get("type") == "abort":
        return f"aborted: {str(reason.get('message'))[:300]}"
    ids = reply.get("output_ids")
    if not isinstance(ids, list):
        return "no output_ids in the answer"
    if len(ids) != req.new_tokens:
        return f"{len(ids)} output ids, {req.new_tokens} asked with ignore_eos"
    if req.kind == "logprob":
        logprobs = meta.get("input_token_logprobs")
        count = len(logprobs) if isinstance(logprobs, list) else None
        if count != req.prompt_len:
            return f"input_token_logprobs has {count} entries for a prompt of {req.prompt_len} tokens"
    return None


def run_load(base: str, requests: list[LoadRequest], timeout: float) -> dict[str, Any]:
    """Every request from its own thread, released together by one barrier; waits for all."""
    failures: list[str | None] = [None] * len(requests)
    gate = threading.Barrier(len(requests) + 1)

    def send(i: int, req: LoadRequest) -> None:
        gate.wait()
        try:
            failures[i] = check_reply(req, server_check._post(base + "/generate", req.body, timeout))
        except urllib.error.HTTPError as exc:
            failures[i] = f"HTTP {exc.code}: {exc.read()[:300].decode(errors='replace')}"
        except Exception as exc:  # noqa: BLE001 - a failed request, counted
            failures[i] = f"{type(exc).__name__}: {exc}"[:300]

    threads = [threading.Thread(target=send, args=(i, r), daemon=True) for i, r in enumerate(requests)]
    for t in threads:
        t.start()
    gate.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    kinds: dict[str, dict[str, int]] = {}
    for req, failure in zip(requests, failures, strict=True):
        k = kinds.setdefault(req.kind, {"sent": 0, "failed": 0, "prompt_len": req.prompt_len,
                                        "new_tokens": req.new_tokens})
        k["sent"] += 1
        k["failed"] += failure is not None
    failed = [f"{req.kind}: {f}" for req, f in zip(requests, failures, strict=True) if f is not None]
    return {"wall_s": round(wall, 1), "sent": len(requests), "failed": len(failed), "kinds": kinds,
            "failures": failed[:20],
            "generated_tokens": sum(r.new_tokens for r, f in zip(requests, failures, strict=True) if f is None)}


# --- one variant ------------------------------------------------------------------------------------
def _server_sizes(log_path: Path, timeout: float) -> dict[str, Any]:
    """The launcher's resolved chunk and decode batch (its server_args line), read once healthy."""
    deadline = time.time() + timeout
    while True:
        sizes = parse_server_args(log_path.read_text(errors="replace"))
        if sizes.get("chunked_prefill_size") or time.time() > deadline:
            return sizes
        time.sleep(0.5)


def _scheduler_line(log_path: Path) -> dict[str, Any]:
    found: dict[str, Any] = parse_memory_log(log_path.read_text(errors="replace")).get("scheduler", {})
    return found


def run_variant(args: argparse.Namespace, variant: str, out_dir: Path) -> dict[str, Any]:
    model = str(Path(args.model).resolve())
    config = json.loads((Path(model) / "config.json").read_text())
    port = server_check.free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = out_dir / f"server-{variant}.log"
    cmd = server_command(model, port, variant, args.chunked_prefill_size, args.cuda_graph_max_bs_decode,
                         args.server_arg)
    env = variant_env(variant, args.plugin_path)
    result: dict[str, Any] = {
        "variant": variant, "command": " ".join(cmd[1:]), "ok": False,
        "env": {k: env[k] for k in sorted(env) if k.startswith(("SGLANG_ENABLE_", "SGLANG_BCG_"))},
        "model": {k: config.get(k) for k in ("hidden_size", "num_hidden_layers", "num_key_value_heads",
                                             "head_dim", "vocab_size")},
        "kv_bytes_per_token": kv_bytes_per_token(config)}
    marks: dict[str, float] = {}
    sampler = MemorySampler(out_dir / f"memory-{variant}.txt", args.sample_ms, args.gpu, args.sampler).start()
    result["sampler"] = sampler.source
    time.sleep(1.0)  # a few samples of the card before the server
    proc = None
    try:
        workdir = tempfile.mkdtemp(prefix=f"sglang-gap-{variant}-")
        marks["start"] = time.time()
        with log_path.open("wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=workdir,
                                    start_new_session=True)
        result["server_up_s"] = round(server_check.wait_healthy(base, proc, args.start_timeout), 1)
        marks["healthy"] = time.time()
        sizes = _server_sizes(log_path, 10.0)
        scheduler = _scheduler_line(log_path)
        chunk = args.chunked_prefill_size or sizes.get("chunked_prefill_size") or scheduler.get("chunked_prefill_size")
        batch = args.decode_batch or sizes.get("decode_max_bs")
        if not chunk or not batch:
            msg = (f"the server's chunk ({chunk}) or decode batch ({batch}) is not in its log: pass "
                   "--chunked-prefill-size and --decode-batch")
            raise RuntimeError(msg)
        context = scheduler.get("context_len") or config.get("max_position_embeddings")
        logprob_tokens = args.logprob_tokens or min(2 * int(chunk), int(context) - args.logprob_new_tokens)
        shape = LoadShape(chunk=int(chunk), decode_batch=int(batch), chunk_prompts=args.chunk_prompts,
                          chunk_new_tokens=args.chunk_new_tokens, logprob_prompts=args.logprob_prompts,
                          logprob_tokens=logprob_tokens, logprob_new_tokens=args.logprob_new_tokens,
                          decode_prompt_tokens=args.decode_prompt_tokens, new_tokens=args.new_tokens)
        shape.check(int(context))
        result["load_shape"] = vars(shape)
        greedy = server_check.prompts(args.greedy_lengths, ID_BOUND)
        result["greedy_lengths"] = list(args.greedy_lengths)
        result["greedy"] = [server_check.generate(base, ids, args.greedy_new_tokens, args.request_timeout)["output_ids"]
                            for ids in greedy]
        requests = build_load(shape, ID_BOUND)
        marks["load_start"] = time.time()
        result["load"] = run_load(base, requests, args.request_timeout)
        marks["load_end"] = time.time()
        result["server_alive_after_load"] = proc.poll() is None
        result["ok"] = result["load"]["failed"] == 0 and result["server_alive_after_load"]
    except Exception as exc:  # noqa: BLE001 - reported in the result, with the log's tail
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        # exited on its own before being stopped: died (in capture, or under the load)
        result["died"] = proc is not None and proc.poll() is not None
        if proc is not None:
            server_check.stop(proc)
        marks["stop"] = time.time()
        result["released_s"] = _wait_released(sampler, args.release_timeout)
        sampler.stop()
    result["wall_s"] = round(marks["stop"] - marks["start"], 1) if "start" in marks else None
    result["marks"] = {k: round(v, 3) for k, v in marks.items()}
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    result["log"] = parse_memory_log(text)
    result["plugin"] = {k: v for k, v in server_check.parse_log(text).items()
                        if k in ("plugin_loaded", "forecast", "after")}
    result["memory"] = memory_summary(parse_samples(sampler.path.read_text()), marks)
    result.update(headline(result))
    if not result["ok"]:
        result["log_tail"] = text[-4000:]
    return result


def _wait_released(sampler: MemorySampler, timeout: float) -> float | None:
    """Seconds until the card's used memory is back near what it was before the server, so the
    next variant starts on an empty card; ``None`` when unknown or not within ``timeout``."""
    samples = parse_samples(sampler.path.read_text()) if sampler.path.exists() else []
    if not samples:
        return None
    floor = samples[0].used_mib + 1024
    t0 = time.time()
    while time.time() - t0 < timeout:
        used = sampler.used_mib()
        if used is not None and used <= floor:
            return round(time.time() - t0, 1)
        time.sleep(0.5)
    return None


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """The summary's figures of one variant's result."""
    log, mem = result.get("log", {}), result.get("memory", {})
    unused = mem.get("unused_at_peak_mib")
    per_token = result.get("kv_bytes_per_token")
    return {"mem_fraction_static": log.get("server_args", {}).get("mem_fraction_static"),
            "kv_tokens": kv_tokens(log), "free_after_capture_gib": free_after_capture_gib(log),
            "peak_used_gib": _gib(mem.get("peak_used_mib")), "unused_at_peak_gib": _gib(unused),
            "unused_at_peak_kv_tokens": int(unused * MIB // per_token) if unused is not None and per_token else None,
            "failed": (result.get("load") or {}).get("failed"), "oom": bool(log.get("oom_lines")),
            "plan_vs_peak": plan_vs_peak(log.get("plan"), mem.get("peak_used_mib"))}


def plan_vs_peak(plan: dict[str, Any] | None, peak_mib: float | None) -> float | None:
    """(the plan's planned peak - the peak used) / the peak used (``None``: no plan or no peak)."""
    planned = (plan or {}).get("planned_peak_gib")
    if planned is None or not peak_mib:
        return None
    return round((planned * 1024 - peak_mib) / peak_mib, 4)


def _gib(mib: float | None) -> float | None:
    return None if mib is None else round(mib / 1024, 2)


# --- the summary ------------------------------------------------------------------------------------
COLUMNS = (("variant", "variant"), ("fraction", "mem_fraction_static"), ("KV tokens", "kv_tokens"),
           ("free after capture GiB", "free_after_capture_gib"), ("peak used GiB", "peak_used_gib"),
           ("unused at peak GiB", "unused_at_peak_gib"), ("failed", "failed"), ("OOM", "oom"),
           ("died", "died"), ("ids = stock", "ids_as_stock"), ("plan vs peak", "plan_vs_peak"))


def summary_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per variant; ``ids_as_stock``: its greedy ids equal stock's (``None`` without both)."""
    stock = next((r.get("greedy") for r in results if r["variant"] == "stock"), None)
    rows = []
    for r in results:
        row = {key: r.get(key) for _, key in COLUMNS}
        row["variant"] = r["variant"]
        row["ids_as_stock"] = None if stock is None or r.get("greedy") is None else r["greedy"] == stock
        rows.append(row)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    def cell(value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, bool):
            return "yes" if value else "no"
        if isinstance(value, float):
            return f"{value:.3f}" if value < 1 else f"{value:,.2f}"
        return f"{value:,}" if isinstance(value, int) else str(value)

    table = [[title for title, _ in COLUMNS]] + [[cell(row.get(key)) for _, key in COLUMNS] for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(COLUMNS))]
    lines = [" | ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths, strict=True)))
             for line in table]
    lines.insert(1, "-|-".join("-" * w for w in widths))
    return "\n".join(lines)


def _lengths(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a model directory (make_model.py --shape llama3-8b)")
    ap.add_argument("--variants", default="stock,post-capture", help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--plugin-path", help="the directory the plugin is installed in (setup.sh: $PLUGIN_SITE)")
    ap.add_argument("--out-dir", default="memory-gap", help="JSON, server logs and memory samples go here")
    ap.add_argument("--summarize", metavar="DIR", help="print the table of DIR's memory-gap-*.json and exit")
    sizes = ap.add_argument_group("sizes SGLang chooses unless given")
    sizes.add_argument("--chunked-prefill-size", type=int, help="pass this chunk (default: SGLang's for the card)")
    sizes.add_argument("--cuda-graph-max-bs-decode", type=int, help="pass this decode graph batch (default: SGLang's)")
    sizes.add_argument("--server-arg", action="append", default=[], help="one more launch_server argument")
    load = ap.add_argument_group("the adversarial load")
    load.add_argument("--decode-batch", type=int, help="concurrent decode requests (default: the server's decode "
                      "graph batch, 256 on an H200)")
    load.add_argument("--decode-prompt-tokens", type=int, default=512)
    load.add_argument("--new-tokens", type=int, default=256, help="new tokens per decode request (ignore_eos)")
    load.add_argument("--chunk-prompts", type=int, default=4, help="prompts of the full chunk")
    load.add_argument("--chunk-new-tokens", type=int, default=16)
    load.add_argument("--logprob-prompts", type=int, default=2, help="requests with input logprobs from token 0")
    load.add_argument("--logprob-tokens", type=int, help="their prompt length (default: 2 chunks, within the context)")
    load.add_argument("--logprob-new-tokens", type=int, default=8)
    load.add_argument("--greedy-lengths", type=_lengths, default=GREEDY_LENGTHS,
                      help="prompt lengths of the greedy ids taken before the load (comma-separated)")
    load.add_argument("--greedy-new-tokens", type=int, default=12)
    limits = ap.add_argument_group("limits")
    limits.add_argument("--start-timeout", type=float, default=300.0, help="seconds for /health")
    limits.add_argument("--request-timeout", type=float, default=240.0, help="seconds per request")
    limits.add_argument("--release-timeout", type=float, default=60.0,
                        help="seconds to wait for the card's memory to come back after a server")
    limits.add_argument("--sample-ms", type=int, default=100, help="memory sampling interval")
    limits.add_argument("--sampler", choices=("auto", "nvidia-smi", "pynvml"), default="auto")
    limits.add_argument("--gpu", type=int, default=0, help="the card nvidia-smi / NVML reads")
    args = ap.parse_args(argv)
    unknown = [v for v in args.variants.split(",") if v.strip() and v.strip() not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    if not args.summarize and not args.model:
        ap.error("--model is required (or --summarize DIR)")
    return args


def load_results(out_dir: Path) -> list[dict[str, Any]]:
    order = list(VARIANTS)
    found = [json.loads(p.read_text()) for p in out_dir.glob("memory-gap-*.json")]
    return sorted(found, key=lambda r: order.index(r["variant"]) if r["variant"] in order else len(order))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.summarize:
        results = load_results(Path(args.summarize))
        print(format_table(summary_rows(results)))
        return 0 if results else 1
    out_dir = Path(args.out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for variant in [v.strip() for v in args.variants.split(",") if v.strip()]:
        result = run_variant(args, variant, out_dir)
        (out_dir / f"memory-gap-{variant}.json").write_text(json.dumps(result, indent=1) + "\n")
        print(f"memory gap {variant}: " + json.dumps({k: v for k, v in result.items()
                                                     if k not in ("greedy", "log_tail", "log", "marks")}), flush=True)
        results.append(result)
    print(format_table(summary_rows(results)), flush=True)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
