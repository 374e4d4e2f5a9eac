"""``scripts/server/memory_gap.py`` without a server: SGLang 0.5.23's memory lines as it formats
them (each case below is the release's own format string, copied, filled with our numbers; with
0.5.23's sources at hand, the last test renders the same lines from those sources), the device
memory samples and their peak, the adversarial load and how its answers are judged, the command
and environment of each variant, and the summary table."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import os
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "server" / "memory_gap.py"
GIB = 1 << 30


def _load() -> ModuleType:
    if "_memory_gap" in sys.modules:
        return sys.modules["_memory_gap"]
    spec = importlib.util.spec_from_file_location("_memory_gap", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


gap = _load()


# --- SGLang 0.5.23's lines: (file under sglang/srt, the pattern's fixed start, values in order, line) ---
def _server_args(mem_fraction_static: float = 0.9, decode_max_bs: int = 256) -> tuple[list[Any], str]:
    resolved = {"model_path": "/tmp/model", "mem_fraction_static": mem_fraction_static, "max_running_requests": None,
                "max_total_tokens": None, "chunked_prefill_size": 8192,
                "cuda_graph_config": {"decode": {"backend": "full", "max_bs": decode_max_bs,
                                                 "bs": list(range(1, 17)) + list(range(24, decode_max_bs + 1, 8))},
                                      "prefill": {"backend": "breakable", "max_bs": 8192,
                                                  "bs": list(range(16, 8193, 16))[:58]}}}
    # entrypoints/engine.py: logger.info(f"server_args={_server_args_for_logging(server_args)}")
    return [resolved], f"server_args={resolved}"


def _load_begin(avail: float = 139.52) -> tuple[list[Any], str]:
    return [avail], f"Load weight begin. avail mem={avail:.2f} GB"


def _load_end(weight_load_time: float = 3.467, name: str = "LlamaForCausalLM", quant_str: str = "",
              after_avail_memory: float = 124.5049, weight_load_mem_usage: float = 15.0151) -> tuple[list[Any], str]:
    line = (f"Load weight end. "
            f"elapsed={weight_load_time:.2f} s, "
            f"type={name}, "
            f"{quant_str + ', ' if quant_str else ''}"
            f"avail mem={after_avail_memory:.2f} GB, "
            f"mem usage={weight_load_mem_usage:.2f} GB.")
    return [weight_load_time, name, quant_str + ", " if quant_str else "", after_avail_memory,
            weight_load_mem_usage], line


def _kv_allocated(post_capture_active: bool = False, num_tokens: int = 861_000, k_size_gb: float = 52.55,
                  v_size_gb: float = 52.55) -> tuple[list[Any], str]:
    cache_name, dtype = "KV Cache", "torch.bfloat16"
    k_size_GB, v_size_GB = k_size_gb, v_size_gb  # SGLang's names
    line = (f"{cache_name} {'VA upper bound' if post_capture_active else 'is allocated'}. dtype: {dtype}, "
            f"#tokens: {num_tokens}, K size: {k_size_GB:.2f} GB, "
            f"V size: {v_size_GB:.2f} GB")
    return [cache_name, "VA upper bound" if post_capture_active else "is allocated", dtype, num_tokens, k_size_GB,
            v_size_GB], line


def _pool_end(avail: float = 19.31) -> tuple[list[Any], str]:
    return [avail], (f"Memory pool end. "
                     f"avail mem={avail:.2f} GB")


def _prefill_begin(before_mem: float = 19.2, num_tokens: tuple[int, ...] = (16, 32, 8192)) -> tuple[list[Any], str]:
    capture_name, prefill_backend, capture_num_tokens = "target prefill", "breakable", list(num_tokens)
    line = (f"Capture {capture_name} CUDA graph begin. "
            f"backend={prefill_backend}, num_tokens={capture_num_tokens}, "
            f"avail mem={before_mem:.2f} GB")
    return [capture_name, prefill_backend, capture_num_tokens, before_mem], line


def _prefill_end(capture_time: float = 41.2, mem_usage: float = 1.87, after_mem: float = 16.17) -> tuple[list[Any], str]:
    capture_name = "target prefill"
    line = (f"Capture {capture_name} CUDA graph end. "
            f"elapsed={capture_time:.2f} s, "
            f"mem usage={mem_usage:.2f} GB, avail mem={after_mem:.2f} GB.")
    return [capture_name, capture_time, mem_usage, after_mem], line


def _decode_begin(before_mem: float = 18.04) -> tuple[list[Any], str]:
    capture_name, backend, decode_backend, num_tokens_per_req = "target decode", "CUDA graph", "full", 1
    line = (f"Capture {capture_name} {backend} begin. "
            f"backend={decode_backend}, num_tokens_per_req={num_tokens_per_req}, "
            f"avail mem={before_mem:.2f} GB")
    return [capture_name, backend, decode_backend, num_tokens_per_req, before_mem], line


def _decode_end(capture_bs: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 256), capture_time: float = 9.87,
                memory_usage_gb: float = 0.71, after_mem: float = 17.33) -> tuple[list[Any], str]:
    capture_name, backend, bs = "target decode", "CUDA graph", list(capture_bs)
    line = (f"Capture {capture_name} {backend} end. "
            f"bs={bs}, "
            f"elapsed={capture_time:.2f} s, "
            f"mem usage={memory_usage_gb:.2f} GB, avail mem={after_mem:.2f} GB.")
    return [capture_name, backend, bs, capture_time, memory_usage_gb, after_mem], line


def _post_capture(tokens: int = 905_123, kv_gb: float = 110.48, avail: float = 1.61) -> tuple[list[Any], str]:
    values = ["torch.bfloat16", tokens, kv_gb, avail]
    # SGLang's logger.info("...%s...", ...) arguments, formatted as logging does
    return values, ("Post-capture KV sizing: KV cache allocated. dtype: %s, #tokens: %d, "  # noqa: UP031
                    "KV size: %.2f GB, avail mem=%.2f GB") % tuple(values)


def _post_capture_gap(decode_max_bs: int = 256, running_requests: int = 4096) -> tuple[list[Any], str]:
    values = [decode_max_bs, running_requests]
    return values, ("Post-capture KV sizing: decode CUDA graph max_bs=%d < "  # noqa: UP031 - SGLang's
                    "max_running_requests=%d; reserving activation headroom") % tuple(values)


def _post_capture_reqs(before: int = 4096, after: int = 3000) -> tuple[list[Any], str]:
    return [before, after], "Post-capture KV sizing: max_running_requests %d -> %d" % (before, after)  # noqa: UP031


def _scheduler(max_total_num_tokens: int = 861_000, available: float = 16.1) -> tuple[list[Any], str]:
    chunked_prefill_size, max_prefill_tokens, max_running_requests, context_len = 8192, 16384, 4096, 32768
    label = "available_gpu_mem"
    line = (f"max_total_num_tokens={max_total_num_tokens}, "
            f"chunked_prefill_size={chunked_prefill_size}, "
            f"max_prefill_tokens={max_prefill_tokens}, "
            f"max_running_requests={max_running_requests}, "
            f"context_len={context_len}, "
            f"{label}="
            f"{available:.2f} GB")
    return [max_total_num_tokens, chunked_prefill_size, max_prefill_tokens, max_running_requests, context_len,
            label, available], line


#: name -> (source file under sglang/srt, the pattern's fixed text up to its first value, the case)
SGLANG_LINES: dict[str, tuple[str, str, Callable[[], tuple[list[Any], str]]]] = {
    "load_begin": ("model_executor/model_runner.py", "Load weight begin. avail mem=", _load_begin),
    "load_end": ("model_executor/model_runner.py", "Load weight end. elapsed=", _load_end),
    "kv": ("mem_cache/memory_pool.py", "", _kv_allocated),
    "pool_end": ("mem_cache/kv_cache_configurator.py", "Memory pool end. avail mem=", _pool_end),
    "prefill_begin": ("model_executor/model_runner_components/cuda_graph_setup.py", "Capture ", _prefill_begin),
    "prefill_end": ("model_executor/model_runner_components/cuda_graph_setup.py", "Capture ", _prefill_end),
    "decode_begin": ("model_executor/model_runner_components/cuda_graph_setup.py", "Capture ", _decode_begin),
    "decode_end": ("model_executor/model_runner_components/cuda_graph_setup.py", "Capture ", _decode_end),
    "post_capture": ("model_executor/model_runner_components/kv_pool_runtime.py",
                     "Post-capture KV sizing: KV cache allocated.", _post_capture),
    "post_capture_gap": ("model_executor/model_runner_components/kv_pool_runtime.py",
                         "Post-capture KV sizing: decode CUDA graph", _post_capture_gap),
    "post_capture_reqs": ("model_executor/model_runner_components/kv_pool_runtime.py",
                          "Post-capture KV sizing: max_running_requests", _post_capture_reqs),
    "scheduler": ("managers/scheduler.py", "max_total_num_tokens=", _scheduler),
}


def _decode_batch(running: int, graph: bool) -> str:
    # managers/scheduler_components/metrics_reporter.py, its pieces in order (token usage, then the graph)
    return (f"Decode batch, #running-req: {running}, #token: {running * 700}, token usage: {0.21:.2f}, "
            f"cuda graph: {graph}, gen throughput (token/s): {9876.5:.2f}, #queue-req: {0}")


def _prefill_batch(seqs: int, tokens: int) -> str:
    return (f"Prefill batch, #new-seq: {seqs}, #new-token: {tokens}, #cached-token: 0, token usage: {0.05:.2f}, "
            f"#running-req: 12, #queue-req: 3, #pending-token: 0, cuda graph: False, "
            f"input throughput (token/s): {12345.67:.2f}")


def _log(*lines: str) -> str:
    """Lines as SGLang's processes write them (time and rank prefix), with unrelated lines between."""
    out = ["[2026-12-07 01:00:00] Using default HuggingFace chat template"]
    for i, line in enumerate(lines):
        out += [f"[2026-12-07 01:00:{i + 1:02d} TP0] {line}", f"[2026-12-07 01:00:{i + 1:02d} TP0] Init torch distributed ends."]
    return "\n".join(out) + "\n"


def test_a_stock_log_gives_the_fraction_the_pool_the_captures_and_the_free_memory() -> None:
    text = _log(_server_args(0.9)[1], _load_begin()[1], _load_end()[1], _kv_allocated()[1], _pool_end()[1],
                _decode_begin()[1], _decode_end()[1], _prefill_begin()[1], _prefill_end()[1], _scheduler()[1],
                _prefill_batch(16, 8192), _decode_batch(200, True), _decode_batch(256, True), _decode_batch(17, False))
    log = gap.parse_memory_log(text)
    args = log["server_args"]
    assert args["mem_fraction_static"] == 0.9 and args["chunked_prefill_size"] == 8192
    assert args["decode_max_bs"] == 256 and args["decode_backend"] == "full"
    assert args["prefill_backend"] == "breakable" and args["prefill_sizes"] == 58 and args["prefill_max_bs"] == 8192
    assert log["load_begin_avail_gib"] == 139.52
    assert log["weights"] == {"elapsed_s": 3.47, "type": "LlamaForCausalLM", "avail_gib": 124.5, "usage_gib": 15.02}
    assert log["kv_pool"] == {"virtual": False, "dtype": "torch.bfloat16", "tokens": 861_000, "size_gib": 105.1}
    assert log["pool_end_avail_gib"] == 19.31
    decode, prefill = log["captures"]
    assert decode == {"role": "target", "phase": "decode", "backend": "full", "avail_before_gib": 18.04,
                      "elapsed_s": 9.87, "mem_usage_gib": 0.71, "avail_after_gib": 17.33, "sizes": 7, "max_bs": 256}
    assert prefill == {"role": "target", "phase": "prefill", "backend": "breakable", "avail_before_gib": 19.2,
                       "elapsed_s": 41.2, "mem_usage_gib": 1.87, "avail_after_gib": 16.17, "sizes": None,
                       "max_bs": None}
    assert log["scheduler"] == {"max_total_num_tokens": 861_000, "chunked_prefill_size": 8192,
                                "max_prefill_tokens": 16384, "max_running_requests": 4096, "context_len": 32768,
                                "available_gpu_mem_gib": 16.1}
    assert log["decode_batches"] == {"logged": 3, "max_running": 256, "eager": 1}
    assert log["prefill_max_new_tokens"] == 8192
    assert "post_capture" not in log and log["oom_lines"] == []
    assert gap.kv_tokens(log) == 861_000 and gap.free_after_capture_gib(log) == 16.1


def test_a_post_capture_log_gives_the_resized_pool() -> None:
    text = _log(_server_args(0.989)[1], _kv_allocated(True, 1_100_000, 67.14, 67.14)[1], _decode_end()[1],
                _prefill_end()[1], _post_capture_gap()[1], _post_capture(905_123, 110.48, 1.61)[1],
                _post_capture_reqs()[1])
    log = gap.parse_memory_log(text)
    assert log["server_args"]["mem_fraction_static"] == 0.989
    assert log["kv_pool"]["virtual"] is True and log["kv_pool"]["tokens"] == 1_100_000
    assert log["post_capture"] == {"tokens": 905_123, "size_gib": 110.48, "avail_gib": 1.61,
                                   "max_running_requests": [4096, 3000],
                                   "eager_decode_gap": {"decode_max_bs": 256, "max_running_requests": 4096}}
    # without the scheduler's line, the post-capture line is the pool and the free memory
    assert gap.kv_tokens(log) == 905_123 and gap.free_after_capture_gib(log) == 1.61
    log = gap.parse_memory_log(text + _log(_scheduler(905_123, 1.58)[1]))
    assert gap.kv_tokens(log) == 905_123 and gap.free_after_capture_gib(log) == 1.58


def test_the_fallbacks_and_the_out_of_memory_lines() -> None:
    log = gap.parse_memory_log(_log(_kv_allocated(num_tokens=1234)[1], _decode_end(after_mem=7.5)[1]))
    assert gap.kv_tokens(log) == 1234 and gap.free_after_capture_gib(log) == 7.5
    assert gap.kv_tokens({}) is None and gap.free_after_capture_gib({"captures": []}) is None
    oom = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.91 GiB. GPU 0 has a total capacity of "
           "139.81 GiB of which 1.02 GiB is free.")
    log = gap.parse_memory_log(_log(_scheduler()[1], oom, "RuntimeError: CUDA error: an illegal memory access"))
    assert len(log["oom_lines"]) == 2 and "Tried to allocate 3.91 GiB" in log["oom_lines"][0]
    assert log["decode_batches"] == {"logged": 0, "max_running": 0, "eager": 0}


def test_server_args_not_a_literal_fall_back_to_the_fields() -> None:
    _, line = _server_args(0.876, 128)
    broken = line.replace("'max_total_tokens': None", "'max_total_tokens': inf")
    assert gap.parse_server_args(broken) == {"mem_fraction_static": 0.876, "chunked_prefill_size": 8192,
                                             "decode_backend": "full", "decode_max_bs": 128}
    assert gap.parse_server_args("no such line") == {}
    # the launcher's last line wins (an Engine logs it twice)
    twice = _log(_server_args(0.5)[1], _server_args(0.7)[1])
    assert gap.parse_server_args(twice)["mem_fraction_static"] == 0.7


def _render(node: ast.expr, values: list[Any]) -> str:
    """An f-string (or a %-format constant) of SGLang's, filled with ``values`` in order."""
    if isinstance(node, ast.Constant):
        return str(node.value) % tuple(values)
    assert isinstance(node, ast.JoinedStr)
    out, it = [], iter(values)
    for part in node.values:
        if isinstance(part, ast.Constant):
            out.append(str(part.value))
            continue
        assert isinstance(part, ast.FormattedValue)
        value = next(it)
        value = {-1: value, 115: str(value), 114: repr(value), 97: ascii(value)}[part.conversion]
        spec = "".join(str(c.value) for c in part.format_spec.values) if isinstance(part.format_spec, ast.JoinedStr) else ""
        out.append(format(value, spec))
    assert next(it, None) is None, "more values than the pattern has fields"
    return "".join(out)


def _patterns(path: Path, start: str) -> Iterator[ast.expr]:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.JoinedStr):
            fixed = "".join(str(v.value) if isinstance(v, ast.Constant) else "\0" for v in node.values)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            fixed = node.value
        else:
            continue
        if fixed.startswith(start) and ("\0" in fixed or "%" in fixed):
            yield node


def _sglang_0523() -> Path | None:
    spec = importlib.util.find_spec("sglang")
    try:
        release = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None
    if spec is None or not spec.submodule_search_locations or release != "0.5.23":
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "srt"


@pytest.mark.sglang
@pytest.mark.skipif(_sglang_0523() is None, reason="needs SGLang 0.5.23's sources (the lines are its)")
@pytest.mark.parametrize("name", sorted(SGLANG_LINES))
def test_every_line_above_is_what_sglang_0_5_23_formats(name: str) -> None:
    srt = _sglang_0523()
    assert srt is not None
    rel, start, case = SGLANG_LINES[name]
    values, line = case()
    rendered = []
    for node in _patterns(srt / rel, start):
        try:
            rendered.append(_render(node, values))
        except (AssertionError, StopIteration, TypeError, ValueError):
            continue  # another pattern with this start (other fields)
    assert line in rendered, f"{name}: {line!r} is not one of SGLang's {rel} patterns: {rendered}"


@pytest.mark.sglang
@pytest.mark.skipif(_sglang_0523() is None, reason="needs SGLang 0.5.23's sources (the lines are its)")
def test_the_server_args_and_batch_lines_are_sglangs() -> None:
    srt = _sglang_0523()
    assert srt is not None
    engine = (srt / "entrypoints" / "engine.py").read_text()
    assert 'logger.info(f"server_args={_server_args_for_logging(server_args)}")' in engine
    reporter = (srt / "managers" / "scheduler_components" / "metrics_reporter.py").read_text()
    for piece in ('f"Decode batch{iter_msg}, #running-req: {num_running_reqs}, {token_usage_msg}"',
                  'f"Prefill batch{iter_msg}, "', 'f"#new-seq: {prefill_stats.num_new_seqs}, "',
                  'f"#new-token: {prefill_stats.log_input_tokens}, "',
                  'f"{self._graph_backend_label}: {can_run_cuda_graph}, "', '"cuda graph")'):
        assert piece in reporter, piece


# --- device memory --------------------------------------------------------------------------------
def test_nvidia_smi_lines_and_the_peak_within_the_load() -> None:
    assert gap.parse_smi_line("81234, 143771\n") == (81234.0, 143771.0)
    for junk in ("[N/A], 143771", "81234", "NVIDIA-SMI has failed", "", "5, 4", "1, 2, 3"):
        assert gap.parse_smi_line(junk) is None, junk
    rows = ("10.0 500", "11.0 500", "12.5 120000", "20.0 128000", "21.0 130500", "21.5 135000", "25.0 131000",
            "30.0 139000", "garbage", "31.0 600")
    text = "".join(f"{row} 143771\n" if row != "garbage" else "garbage\n" for row in rows)
    samples = gap.parse_samples(text)
    assert len(samples) == 9 and samples[2] == gap.Sample(12.5, 120000.0, 143771.0)
    assert gap.peak(samples, 20.0, 25.0) == gap.Sample(21.5, 135000.0, 143771.0)
    assert gap.peak(samples, 26.0, 29.0) is None
    marks = {"start": 11.5, "healthy": 19.0, "load_start": 21.0, "load_end": 26.0, "stop": 30.5}
    mem = gap.memory_summary(samples, marks)
    assert mem == {"samples": 9, "total_mib": 143771.0, "before_start_used_mib": 500.0, "idle_used_mib": 130500.0,
                   "load_samples": 3, "peak_used_mib": 135000.0, "peak_at_s": 0.5, "unused_at_peak_mib": 8771.0,
                   "run_peak_used_mib": 139000.0}  # the spike after the load is not the load's peak
    assert gap.memory_summary([], marks) == {"samples": 0}


def test_the_sampler_stamps_each_nvidia_smi_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/argv\n'
                    'while true; do echo "4096, 81559"; echo "[N/A], 81559"; sleep 0.02; done\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    sampler = gap.MemorySampler(tmp_path / "mem.txt", interval_ms=20, gpu=3)
    assert sampler.source == "nvidia-smi"
    t0 = time.time()
    sampler.start()
    deadline = time.time() + 10
    while sampler.used_mib() is None and time.time() < deadline:
        time.sleep(0.05)
    sampler.stop()
    samples = gap.parse_samples((tmp_path / "mem.txt").read_text())
    assert samples and all(s.used_mib == 4096 and s.total_mib == 81559 for s in samples)
    assert all(t0 <= s.t <= time.time() for s in samples)
    assert [a.t for a in samples] == sorted(a.t for a in samples)
    argv = (tmp_path / "argv").read_text().split()
    assert argv[:2] == ["-i", "3"] and "--query-gpu=memory.used,memory.total" in argv and argv[-2:] == ["-lms", "20"]
    with pytest.raises(ValueError, match="unknown sampler 'dcgm'"):
        gap.MemorySampler(tmp_path / "x.txt", source="dcgm").start()


# --- the load ---------------------------------------------------------------------------------------
def test_the_load_has_every_kind_at_its_size_and_ids_below_the_vocab() -> None:
    shape = gap.LoadShape(chunk=1024, decode_batch=7, chunk_prompts=3, chunk_new_tokens=5, logprob_prompts=2,
                          logprob_tokens=1500, logprob_new_tokens=2, decode_prompt_tokens=40, new_tokens=33)
    load = gap.build_load(shape, vocab=300)
    kinds = [r.kind for r in load]
    assert kinds.count("decode") == 7 and kinds.count("chunk") == 3 and kinds.count("logprob") == 2 and len(load) == 12
    for r in load:
        ids, sp = r.body["input_ids"], r.body["sampling_params"]
        assert len(ids) == r.prompt_len and all(0 <= i < 300 for i in ids)
        assert sp == {"temperature": 0.0, "max_new_tokens": r.new_tokens, "ignore_eos": True}
        want = {"decode": (40, 33), "chunk": (1024, 5), "logprob": (1500, 2)}[r.kind]
        assert (r.prompt_len, r.new_tokens) == want
        if r.kind == "logprob":
            assert r.body["return_logprob"] is True and r.body["logprob_start_len"] == 0
        else:
            assert "return_logprob" not in r.body and "logprob_start_len" not in r.body
    assert len({tuple(r.body["input_ids"][:64]) for r in load}) == len(load)  # every prompt its own
    assert max(max(r.body["input_ids"]) for r in gap.build_load(gap.LoadShape(chunk=64, decode_batch=2))) < gap.ID_BOUND


def test_the_load_refuses_sizes_that_cannot_run() -> None:
    with pytest.raises(ValueError, match="decode_batch must be positive, got 0"):
        gap.LoadShape(chunk=64, decode_batch=0).check()
    with pytest.raises(ValueError, match="logprob_prompts must be at least 0, got -1"):
        gap.build_load(gap.LoadShape(chunk=64, decode_batch=1, logprob_prompts=-1))
    shape = gap.LoadShape(chunk=8192, decode_batch=256, logprob_tokens=16384, logprob_new_tokens=8)
    shape.check(32768)
    with pytest.raises(ValueError, match="logprob prompt of 16384 tokens plus 8 new ones is over the server's context of 16000"):
        shape.check(16000)


def _reply(req: Any, **meta: Any) -> dict[str, Any]:
    return {"text": "", "output_ids": [5] * req.new_tokens, "meta_info": {"finish_reason": {"type": "length"}, **meta}}


def test_how_an_answer_is_judged() -> None:
    decode = gap.LoadRequest("decode", 10, 4, {})
    logprob = gap.LoadRequest("logprob", 6, 2, {})
    assert gap.check_reply(decode, _reply(decode)) is None
    assert gap.check_reply(logprob, _reply(logprob, input_token_logprobs=[[None, 1, None]] + [[-1.0, 2, None]] * 5)) is None
    assert gap.check_reply(logprob, _reply(logprob, input_token_logprobs=[[-1.0, 2, None]] * 5)) == \
        "input_token_logprobs has 5 entries for a prompt of 6 tokens"
    assert gap.check_reply(logprob, _reply(logprob)) == "input_token_logprobs has None entries for a prompt of 6 tokens"
    assert gap.check_reply(decode, [1, 2]) == "the answer is a list, not a JSON object"
    assert gap.check_reply(decode, {"error": "boom"}) == "error in the answer: boom"
    assert gap.check_reply(decode, {"object": "error", "message": "too long"}) == "error in the answer: too long"
    aborted = {"output_ids": [1], "meta_info": {"finish_reason": {"type": "abort", "message": "out of memory"}}}
    assert gap.check_reply(decode, aborted) == "aborted: out of memory"
    assert gap.check_reply(decode, {"meta_info": {}}) == "no output_ids in the answer"
    assert gap.check_reply(decode, {"output_ids": [1, 2, 3]}) == "3 output ids, 4 asked with ignore_eos"


class _FakeServer(ThreadingHTTPServer):
    """``/generate`` answering like SGLang once every expected request is in flight at once; chunk
    prompts get an HTTP 500, logprob requests an abort, decode requests their tokens."""

    request_queue_size = 64  # every connection of the load at once

    def __init__(self, expected: int) -> None:
        self.expected, self.in_flight, self.most = expected, 0, 0
        self.lock, self.all_in = threading.Lock(), threading.Event()
        super().__init__(("127.0.0.1", 0), _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: _FakeServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.in_flight += 1
            self.server.most = max(self.server.most, self.server.in_flight)
            if self.server.in_flight == self.server.expected:
                self.server.all_in.set()
        self.server.all_in.wait(10)
        new = body["sampling_params"]["max_new_tokens"]
        if new == 3:  # the chunk prompts
            status, reply = 500, {"error": {"message": "boom"}}
        elif body.get("return_logprob"):
            status, reply = 200, {"output_ids": [1] * new, "meta_info": {"finish_reason": {"type": "abort", "message": "oom"}}}
        else:
            status, reply = 200, {"output_ids": [1] * new, "meta_info": {"finish_reason": {"type": "length"}}}
        data = json.dumps(reply).encode()
        with self.server.lock:
            self.server.in_flight -= 1
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_the_load_is_sent_all_at_once_and_its_failures_counted() -> None:
    shape = gap.LoadShape(chunk=64, decode_batch=5, chunk_prompts=2, chunk_new_tokens=3, logprob_prompts=1,
                          logprob_tokens=100, logprob_new_tokens=2, decode_prompt_tokens=8, new_tokens=4)
    load = gap.build_load(shape)
    server = _FakeServer(len(load))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        out = gap.run_load(f"http://127.0.0.1:{server.server_address[1]}", load, timeout=30)
    finally:
        server.shutdown()
        server.server_close()
    assert server.most == len(load) == 8  # every request in flight together
    assert out["sent"] == 8 and out["failed"] == 3
    assert out["kinds"] == {"decode": {"sent": 5, "failed": 0, "prompt_len": 8, "new_tokens": 4},
                            "chunk": {"sent": 2, "failed": 2, "prompt_len": 64, "new_tokens": 3},
                            "logprob": {"sent": 1, "failed": 1, "prompt_len": 100, "new_tokens": 2}}
    assert sorted(out["failures"]) == ["chunk: HTTP 500: {\"error\": {\"message\": \"boom\"}}"] * 2 + ["logprob: aborted: oom"]
    assert out["generated_tokens"] == 20


def test_a_refused_connection_is_a_failed_request() -> None:
    load = gap.build_load(gap.LoadShape(chunk=16, decode_batch=2, chunk_prompts=0, logprob_prompts=0, new_tokens=1,
                                        decode_prompt_tokens=4))
    out = gap.run_load(f"http://127.0.0.1:{gap.server_check.free_port()}", load, timeout=5)  # nothing listens
    assert out["failed"] == 2 and all(f.startswith("decode: URLError") for f in out["failures"])


# --- the command, the environment, the summary -------------------------------------------------------
@pytest.fixture
def release_0523(monkeypatch: pytest.MonkeyPatch) -> None:
    check = gap.server_check
    flags = check.release_flags("0.5.23")
    monkeypatch.setattr(check, "release_flags", lambda release=None: flags)


def _option(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


@pytest.mark.usefixtures("release_0523")
def test_the_command_leaves_the_sizes_to_sglang_unless_asked() -> None:
    cmd = gap.server_command("/m", 1234, "stock")
    for name in gap.SIZED_BY_SGLANG:
        assert name not in cmd, name
    assert _option(cmd, "--model-path") == "/m" and _option(cmd, "--port") == "1234"
    assert _option(cmd, "--cuda-graph-backend-prefill") == "breakable" and "--disable-radix-cache" in cmd
    assert not any(w.startswith("--enable-bcg-shared-output") for w in cmd)
    cmd = gap.server_command("/m", 1234, "plugin-on", chunk=4096, decode_max_bs=64, extra=["--max-running-requests", "64"])
    assert _option(cmd, "--chunked-prefill-size") == "4096" and _option(cmd, "--cuda-graph-max-bs-decode") == "64"
    assert "--enable-bcg-shared-output" in cmd and cmd[-2:] == ["--max-running-requests", "64"]
    assert "--mem-fraction-static" not in cmd and "--max-total-tokens" not in cmd
    assert gap.server_command("/m", 1, "post-capture") == gap.server_command("/m", 1, "stock")


def test_options_are_dropped_in_both_spellings() -> None:
    cmd = ["python", "--a", "1", "--mem-fraction-static=0.3", "--b", "--max-total-tokens", "9", "--c", "x"]
    assert gap.without_options(cmd, ("--mem-fraction-static", "--max-total-tokens")) == ["python", "--a", "1", "--b", "--c", "x"]


def test_each_variant_sees_what_it_should(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    plugin = tmp_path / "plugin"
    (plugin / "sglang_bcg_plugin").mkdir(parents=True)
    monkeypatch.setenv("SGLANG_ENABLE_POST_CAPTURE_KV_SIZING", "1")  # from the caller's shell: not for stock
    monkeypatch.setenv("PYTHONPATH", f"{plugin}{os.pathsep}/elsewhere")
    stock = gap.variant_env("stock", str(plugin))
    assert "SGLANG_ENABLE_POST_CAPTURE_KV_SIZING" not in stock and stock["PYTHONPATH"] == "/elsewhere"
    post = gap.variant_env("post-capture", str(plugin))
    assert post["SGLANG_ENABLE_POST_CAPTURE_KV_SIZING"] == "1" and post["PYTHONPATH"] == "/elsewhere"
    on = gap.variant_env("plugin-on", str(plugin))
    assert on["PYTHONPATH"].split(os.pathsep)[0] == str(plugin) and on["SGLANG_BCG_FORECAST"] == "1"
    assert "SGLANG_ENABLE_POST_CAPTURE_KV_SIZING" not in on
    with pytest.raises(ValueError, match="variant 'plugin-on' needs the plugin: pass --plugin-path"):
        gap.variant_env("plugin-on", None)


def test_kv_bytes_per_token_of_llama3_8b() -> None:
    config = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
              "head_dim": 128}
    assert gap.kv_bytes_per_token(config) == 128 * 1024
    del config["head_dim"]
    assert gap.kv_bytes_per_token(config, dtype_bytes=1) == 64 * 1024


def _result(variant: str, greedy: list[list[int]] | None, unused_mib: float | None, failed: int = 0,
            oom: list[str] | None = None) -> dict[str, Any]:
    text = _log(_server_args(0.9)[1], _kv_allocated()[1], _scheduler(861_000, 16.1)[1], *(oom or []))
    result: dict[str, Any] = {"variant": variant, "greedy": greedy, "kv_bytes_per_token": 128 * 1024,
                              "log": gap.parse_memory_log(text), "load": {"failed": failed}, "died": False,
                              "memory": {} if unused_mib is None else {"peak_used_mib": 143771 - unused_mib,
                                                                       "unused_at_peak_mib": unused_mib}}
    result.update(gap.headline(result))
    return result


def test_the_headline_and_the_summary_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stock = _result("stock", [[1, 2], [3]], 10240.0)
    assert stock["mem_fraction_static"] == 0.9 and stock["kv_tokens"] == 861_000
    assert stock["free_after_capture_gib"] == 16.1 and stock["peak_used_gib"] == 130.4
    assert stock["unused_at_peak_gib"] == 10.0 and stock["unused_at_peak_kv_tokens"] == 81_920
    assert stock["failed"] == 0 and stock["oom"] is False
    post = _result("post-capture", [[1, 2], [3]], None, failed=7, oom=["torch.OutOfMemoryError: CUDA out of memory."])
    assert post["oom"] is True and post["peak_used_gib"] is None and post["unused_at_peak_kv_tokens"] is None
    on = _result("plugin-on", [[1, 2], [4]], 2048.0)
    rows = gap.summary_rows([stock, post, on])
    assert [r["ids_as_stock"] for r in rows] == [True, True, False]
    assert gap.summary_rows([on])[0]["ids_as_stock"] is None  # no stock to compare with
    table = gap.format_table(rows).splitlines()
    assert table[0].split(" | ")[0].strip() == "variant" and "unused at peak GiB" in table[0]
    assert set(table[1]) <= {"-", "|"} and len(table) == 5
    cells = [c.strip() for c in table[3].split("|")]
    assert cells == ["post-capture", "0.900", "861,000", "16.10", "-", "-", "7", "yes", "no", "yes", "-"]
    assert [c.strip() for c in table[2].split("|")][3:6] == ["16.10", "130.40", "10.00"]
    # --summarize reprints it from the JSON files, in the variants' order
    for r in (on, stock, post):
        (tmp_path / f"memory-gap-{r['variant']}.json").write_text(json.dumps(r))
    assert gap.main(["--summarize", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines() == table


def test_the_command_line_checks_variants_and_the_model(capsys: pytest.CaptureFixture[str]) -> None:
    args = gap.parse_args(["--model", "/m", "--greedy-lengths", "5,17"])
    assert args.variants == "stock,post-capture" and args.greedy_lengths == (5, 17)
    assert args.chunked_prefill_size is None and args.cuda_graph_max_bs_decode is None and args.decode_batch is None
    with pytest.raises(SystemExit):
        gap.parse_args(["--model", "/m", "--variants", "stock,fast"])
    assert "unknown variants ['fast']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gap.parse_args([])
    assert "--model is required" in capsys.readouterr().err


def test_the_memory_plan_lines_as_the_plugin_logs_them() -> None:
    """The plan's two lines, formatted by the plugin itself, parsed; the plan against the peak."""
    from sglang_bcg_plugin.sglang.memory_plan import GiB, MemoryPlan

    plan = MemoryPlan(total=80 * GiB, free=60 * GiB, weights=15 * GiB, forward=GiB, forward_tokens=8192,
                      logprobs=2 * GiB, logprob_tokens=2048, sampler=0, margin=GiB, kv_bytes_per_token=131072,
                      guess=10 * GiB)
    text = _log(_server_args(0.98)[1]) + "\n[2026-12-07 05:00:00] " + plan.line() + "\n[2026-12-07 05:00:01] " \
        + plan.after_line(plan.kv_tokens, 4 * GiB) + "\n"
    log = gap.parse_memory_log(text)
    assert log["plan"]["eager_gib"] == 3.0 and log["plan"]["margin_gib"] == 1.0 and log["plan"]["kv_gib"] == 56.0
    assert log["plan"]["kv_tokens"] == log["plan"]["backed_tokens"] == plan.kv_tokens
    assert log["plan"]["planned_peak_gib"] == 79.0
    assert gap.plan_vs_peak(log["plan"], 79.0 * 1024) == 0.0
    assert gap.plan_vs_peak(log["plan"], 80.0 * 1024) == pytest.approx(-1 / 80, abs=1e-4)
    assert gap.plan_vs_peak(None, 1.0) is None and gap.plan_vs_peak(log["plan"], None) is None
    line = "sglang_bcg: memory plan: not applied: SGLang allocated this server's KV pool before capture (...)"
    assert gap.parse_memory_log(text + line + "\n")["plan"] == {"not_applied": line}
