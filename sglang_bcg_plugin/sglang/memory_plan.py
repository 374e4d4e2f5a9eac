"""The memory plan (``SGLANG_BCG_MEMORY_PLAN=1``, docs/sglang.md#the-memory-plan): SGLang's KV pool backed
after capture with all the memory the server measured it does not need, instead of a reserve guessed before.

SGLang 0.5.16+ can reserve its KV pool as virtual memory, capture, then back the pool
(``SGLANG_ENABLE_POST_CAPTURE_KV_SIZING``); what it holds back there is still a guess
(``pre_model_load_memory * (1 - mem_fraction_static)``, or an activation reserve by card size). The plan
turns that mode on and replaces the guess with what this process measured: the eager forward at the largest
prefill size (its capture's warm-ups), one input-logprob chunk (the LM head and a float32 log-softmax, run),
SGLang's own sampler measurement, plus a stated margin."""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .._words import parse_bool_env
from .compat import tp_agree
from .incremental import pending_sizes

log = logging.getLogger("sglang_bcg_plugin")

ENV_PLAN = "SGLANG_BCG_MEMORY_PLAN"
ENV_MARGIN = "SGLANG_BCG_MEMORY_PLAN_MARGIN_MIB"
ENV_POST_CAPTURE = "SGLANG_ENABLE_POST_CAPTURE_KV_SIZING"
ENV_FORECAST = "SGLANG_BCG_FORECAST"
RESIZE_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.post_capture_resize_kv_pool"
RUNTIME_MODULE = "sglang.srt.model_executor.model_runner_components.kv_pool_runtime"
#: The release's activation reserve (0.5.18+), which the plan's reserve replaces while SGLang sizes the pool.
RESERVE_FUNCTION = "pre_capture_activation_reserve_mb"
MiB, GiB = 1 << 20, 1 << 30
DEFAULT_MARGIN_MIB = 1024


def plan_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``SGLANG_BCG_MEMORY_PLAN`` asks for the plan (:raises ValueError: not a boolean)."""
    return bool(parse_bool_env(ENV_PLAN, os.environ if environ is None else environ))


def margin_bytes(environ: Mapping[str, str] | None = None) -> int:
    """``SGLANG_BCG_MEMORY_PLAN_MARGIN_MIB`` (default 1024) in bytes. :raises ValueError: not a whole number >= 0."""
    env = os.environ if environ is None else environ
    text = (env.get(ENV_MARGIN) or "").strip()
    if not text:
        return DEFAULT_MARGIN_MIB * MiB
    if not text.isdigit():
        msg = f"{ENV_MARGIN}={text!r}: give the margin as a whole number of MiB (default {DEFAULT_MARGIN_MIB})"
        raise ValueError(msg)
    return int(text) * MiB


def prepare(environ: dict[str, str] | None = None) -> bool:
    """At plugin load, in every process: with the plan asked, SGLang's post-capture KV sizing on (unless the
    operator set it) and the graph memory forecast on (a live switch is checked against it). Returns whether
    the plan is on; an unreadable value is left for the flag's check."""
    env = os.environ if environ is None else environ
    with contextlib.suppress(ValueError):
        if plan_enabled(env):
            env.setdefault(ENV_POST_CAPTURE, "1")
            env.setdefault(ENV_FORECAST, "1")
            return True
    return False


@dataclass
class EagerPeaks:
    """The largest eager working set seen at a capture's warm-up in this process, and its size."""

    bytes: int = 0
    tokens: int = 0

    @contextlib.contextmanager
    def measuring(self, tokens: int) -> Iterator[None]:
        """Measure the allocator's peak over the block (CUDA and the plan on; else nothing)."""
        if not (torch.cuda.is_available() and plan_enabled()):
            yield
            return
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        yield
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        if peak > self.bytes:
            self.bytes, self.tokens = peak, tokens


EAGER = EagerPeaks()
#: The plans this process made (its model runner's; the live switch reads the last).
MADE: list[MemoryPlan] = []


@dataclass(frozen=True)
class MemoryPlan:
    """What the server needs beside its KV pool, measured after capture, and the pool that leaves (bytes)."""

    total: int  #: the card
    free: int  #: free when the plan is made: weights, graphs, buffers and the driver's share are taken
    weights: int  #: SGLang's own figure for the weights (0: unknown)
    forward: int  #: the eager forward at the largest prefill size (its warm-up's allocator peak)
    forward_tokens: int
    logprobs: int  #: one input-logprob chunk: the LM head's logits and their float32 log-softmax
    logprob_tokens: int
    sampler: int  #: SGLang's sampling prewarm (0 where the release has none)
    margin: int
    kv_bytes_per_token: int
    guess: int  #: what SGLang would have held back instead
    pending_graphs: int = 0  #: the prefill graphs an incremental capture has yet to take (forecast)

    @property
    def eager(self) -> int:
        """The eager working set: the forward, a logprob chunk and the sampler, all at once (SGLang's overlap
        scheduler runs one batch's forward while another's results are on the device)."""
        return self.forward + self.logprobs + self.sampler

    @property
    def reserve(self) -> int:
        """What the KV pool leaves free: the eager working set, the graphs still to capture and the margin."""
        return self.eager + self.pending_graphs + self.margin

    @property
    def kv_bytes(self) -> int:
        return max(0, self.free - self.reserve)

    @property
    def kv_tokens(self) -> int:
        return self.kv_bytes // self.kv_bytes_per_token if self.kv_bytes_per_token > 0 else 0

    @property
    def planned_peak(self) -> int:
        """What the server is planned to use at its peak: everything but the margin."""
        return self.total - self.free + self.kv_bytes + self.eager + self.pending_graphs

    def line(self) -> str:
        taken = self.total - self.free
        weights = (f"weights {g(self.weights)}, graphs and buffers {g(taken - self.weights)}" if self.weights
                   else f"weights, graphs and buffers {g(taken)}")
        kv = f"KV {g(self.kv_bytes)}" + (f" = {self.kv_tokens} tokens" if self.kv_bytes_per_token else "")
        return (f"sglang_bcg: memory plan: card {g(self.total)} = {weights} (captured, measured) + eager "
                f"{g(self.eager)} (forward at {self.forward_tokens} tokens {g(self.forward)}, logprobs over "
                f"{self.logprob_tokens} tokens {g(self.logprobs)}, sampler {g(self.sampler)}) + "
                + (f"prefill graphs still to capture {g(self.pending_graphs)} (forecast) + " if self.pending_graphs
                   else "") + f"margin {g(self.margin)} + {kv}; {self.against_sglang()}")

    def against_sglang(self) -> str:
        """The plan's headroom against SGLang's, and what that does to the KV pool."""
        more = self.guess - self.reserve
        tokens = abs(more) // self.kv_bytes_per_token if self.kv_bytes_per_token else 0
        pool = f"{tokens} tokens ({g(abs(more))})" if self.kv_bytes_per_token else g(abs(more))
        if more >= 0:
            return f"SGLang's headroom {g(self.guess)}: the KV pool {pool} larger than SGLang's"
        return (f"SGLang's headroom {g(self.guess)} is too small for the eager working set: the KV pool shrunk by "
                f"{pool} to leave it room")

    def after_line(self, tokens: int, free_after: int) -> str:
        """After the pool is backed: the plan against what was taken."""
        return (f"sglang_bcg: memory plan: KV backed {tokens} tokens ({g(tokens * self.kv_bytes_per_token)}; planned "
                f"{self.kv_tokens}); free {g(free_after)} (planned: eager and margin {g(self.reserve)}); planned peak "
                f"{g(self.planned_peak)}")


def g(n: int) -> str:
    """Bytes as GiB, two decimals."""
    return f"{n / GiB:.2f} GiB"


def logprob_chunk_tokens(chunk: int) -> int:
    """Tokens one input-logprob pass covers: SGLang's ``SGLANG_LOGPROB_CHUNK_SIZE`` where the release chunks."""
    envs = getattr(importlib.import_module("sglang.srt.environ"), "envs", None)
    enabled, size = (getattr(envs, name, None) for name in ("SGLANG_ENABLE_LOGPROB_CHUNK", "SGLANG_LOGPROB_CHUNK_SIZE"))
    if enabled is not None and size is not None and enabled.get():
        return min(chunk, int(size.get()))
    return chunk


def lm_head_weight(model: Any) -> torch.Tensor | None:
    """The weight the model's logits come from (its LM head, or the tied embedding)."""
    for path in (("lm_head", "weight"), ("model", "embed_tokens", "weight")):
        obj = model
        for name in path:
            obj = getattr(obj, name, None)
        if isinstance(obj, torch.Tensor) and obj.dim() == 2:
            return obj
    return None


def measure_logprobs(weight: torch.Tensor, tokens: int) -> int:
    """The allocator's peak over one logprob chunk: logits of ``tokens`` hidden rows, in float32, log-softmaxed."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    hidden = torch.zeros(tokens, weight.shape[1], dtype=weight.dtype, device=weight.device)
    logits = torch.matmul(hidden, weight.t()).float()
    logprobs = torch.log_softmax(logits, dim=-1)
    del hidden, logits, logprobs
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated() - before)


def kv_bytes_per_token(model_runner: Any) -> int:
    """Bytes of the KV pool per token (its buffers' row sizes; 0: unknown)."""
    pool = getattr(model_runner, "token_to_kv_pool", None)
    total = 0
    for name in ("k_buffer", "v_buffer"):
        for buf in getattr(pool, name, None) or ():
            if isinstance(buf, torch.Tensor) and buf.dim() >= 1 and buf.shape[0] > 0:
                total += buf[0].numel() * buf.element_size()
    return total


def pending_graph_bytes(runner: Any) -> int:
    """What the prefill graphs an incremental capture has yet to capture will take: the forecast of the whole
    schedule less what its pool took so far (0: nothing pending, or no forecast)."""
    if not pending_sizes(runner):
        return 0
    forecast = getattr(getattr(runner, "backend", None), "_bcg_forecast", None)
    backend = getattr(runner, "backend", None)
    modes, mode = forecast_modes(backend), getattr(forecast, "mode", None)
    if mode is None or mode not in modes:
        return 0
    taken = forecast._pool_bytes() - forecast.held_at_start  # type: ignore[union-attr]
    return max(0, int(modes[mode].total_bytes) - taken)


def make_plan(model_runner: Any, environ: Mapping[str, str] | None = None) -> MemoryPlan:
    """The plan for ``model_runner`` now (after capture, before the pool is backed). CUDA only."""
    server_args = getattr(model_runner, "server_args", None)
    chunk = int(getattr(server_args, "chunked_prefill_size", 0) or 0) or EAGER.tokens
    weight = lm_head_weight(getattr(model_runner, "model", None))
    tokens = logprob_chunk_tokens(chunk) if chunk > 0 else 0
    logprobs = measure_logprobs(weight, tokens) if weight is not None and tokens > 0 else 0
    torch.cuda.empty_cache()
    free, total = (int(x) for x in torch.cuda.mem_get_info())
    prewarm = getattr(model_runner, "sampling_prewarm_result", None)
    pre_load = float(getattr(model_runner, "pre_model_load_memory", 0) or 0)
    fraction = float(getattr(model_runner, "mem_fraction_static", 0) or 0)
    weights = int(float(getattr(model_runner, "weight_load_mem_usage", 0) or 0) * GiB)
    sampler = int(getattr(prewarm, "sampling_headroom_bytes", 0) or 0)
    pending = pending_graph_bytes(getattr(model_runner, "prefill_cuda_graph_runner", None))
    return MemoryPlan(pending_graphs=pending, total=total, free=free, weights=weights, forward=EAGER.bytes,
                      forward_tokens=EAGER.tokens,
                      logprobs=logprobs, logprob_tokens=tokens, sampler=sampler, margin=margin_bytes(environ),
                      kv_bytes_per_token=kv_bytes_per_token(model_runner), guess=int(pre_load * (1 - fraction) * GiB))


@contextlib.contextmanager
def holding_back(model_runner: Any, reserve: int) -> Iterator[None]:
    """While SGLang sizes the pool: its headroom is ``reserve`` (the fraction it derives the headroom from, and
    the release's activation reserve where it has one), restored after."""
    runtime = importlib.import_module(RUNTIME_MODULE)
    pre_load = float(model_runner.pre_model_load_memory)
    fraction, had = model_runner.mem_fraction_static, getattr(runtime, RESERVE_FUNCTION, None)
    model_runner.mem_fraction_static = 1 - reserve / GiB / pre_load
    if had is not None:
        setattr(runtime, RESERVE_FUNCTION, lambda *args, **kwargs: reserve / MiB)
    try:
        yield
    finally:
        model_runner.mem_fraction_static = fraction
        if had is not None:
            setattr(runtime, RESERVE_FUNCTION, had)


def around_post_capture_resize(original_fn: Callable[..., Any], model_runner: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of ``ModelRunner.post_capture_resize_kv_pool`` (0.5.16+): with the plan on, SGLang backs the
    pool with what the plan leaves, and the plan's two lines are logged."""
    if not (plan_enabled() and torch.cuda.is_available()):
        return original_fn(model_runner, *args, **kwargs)
    plan = make_plan(model_runner)
    MADE.append(plan)
    log.info(plan.line())
    # each rank measures its own; SGLang sizes every rank's pool from the smallest free memory: the largest reserve
    with holding_back(model_runner, tp_agree(plan.reserve, largest=True)):
        result = original_fn(model_runner, *args, **kwargs)
    torch.cuda.empty_cache()
    log.info(plan.after_line(int(getattr(model_runner, "max_total_num_tokens", 0) or 0),
                             int(torch.cuda.mem_get_info()[0])))
    return result


def check_environment(environ: Mapping[str, str]) -> None:
    """At launch: the plan's variables readable, SGLang's post-capture sizing not turned off under it.
    :raises ValueError: one line naming the variable."""
    if not plan_enabled(environ):
        return
    margin_bytes(environ)
    post_capture = None
    with contextlib.suppress(ValueError):  # a value SGLang reads its own way
        post_capture = parse_bool_env(ENV_POST_CAPTURE, environ)
    if post_capture is False:
        msg = (f"{ENV_PLAN}=1 backs the KV pool after capture, which {ENV_POST_CAPTURE}="
               f"{environ.get(ENV_POST_CAPTURE)!r} turns off: unset one of them")
        raise ValueError(msg)


_TOLD: set[str] = set()


def tell_once(line: str | None) -> None:
    """Log ``line`` as a warning, once per process."""
    if line is not None and line not in _TOLD:
        _TOLD.add(line)
        log.warning(line)


def not_applied(model_runner: Any) -> str | None:
    """With the plan on, why it cannot size this runner's pool (``None``: it can): the pool was allocated
    before capture (a release before 0.5.16, or a server SGLang sizes that way: MLA, memory saver, ...)."""
    if not plan_enabled() or getattr(getattr(model_runner, "token_to_kv_pool", None), "post_capture_active", False):
        return None
    return ("sglang_bcg: memory plan: not applied: SGLang allocated this server's KV pool before capture "
            "(post-capture KV sizing is on from SGLang 0.5.16 and off for MLA models, the memory saver, dcp > 1 and "
            "non-CUDA devices); its own sizing stands")


# -- the live switch ---------------------------------------------------------------------------------------
def forecast_modes(backend: Any, wait: bool = True) -> Mapping[str, Any]:
    """The per-mode forecast of the backend's last capture session (empty: none was made). ``wait=False``: only
    one made already (empty while it is still being made, or left for later by incremental capture)."""
    session = getattr(backend, "_bcg_forecast", None)
    forecast = getattr(session, "forecast" if wait else "ready", None) or {}
    return dict(forecast.get("modes") or {})


def plan_made() -> bool:
    """Whether this process made a memory plan (a live switch is then checked against it)."""
    return bool(MADE)


def graph_change(modes: Mapping[str, Any], previous: str | None, mode: str) -> int | None:
    """What the prefill graphs in ``mode`` take beyond those in ``previous`` (bytes, negative: they free), from
    the forecast's ``modes`` (``None``: it has not both)."""
    if previous is None or previous not in modes or mode not in modes:
        return None
    return int(modes[mode].total_bytes - modes[previous].total_bytes)


def switch_refusal(modes: Mapping[str, Any], previous: str | None, mode: str, free: int) -> str | None:
    """With a plan made here: why the switch from ``previous`` to ``mode`` would not fit beside the backed KV
    pool (its graphs would take the eager working set's memory or the margin), in one line; ``None``: it fits,
    or there is no plan to keep."""
    if not MADE or (change := graph_change(modes, previous, mode)) is None:
        return None
    plan = MADE[-1]
    if change <= free - plan.reserve:
        return None
    return (f"the memory plan: the prefill graphs in {mode} take {change / MiB:,.0f} MiB more than in {previous} "
            f"(forecast), and {g(free)} is free beside the KV pool, of which the eager working set and the margin "
            f"need {g(plan.reserve)}: restart with --enable-bcg-shared-output={mode} (the plan then sizes the pool "
            "for it)")


def switch_headroom(default: int) -> int:
    """What a live switch must leave free for serving: the plan's eager working set and margin (``default``: no
    plan made here)."""
    if not MADE:
        return default
    return MADE[-1].eager + MADE[-1].margin


def after_switch_line(modes: Mapping[str, Any], previous: str | None, mode: str, free: int) -> str | None:
    """After a switch, with a plan made here: the plan's line again, for the new mode."""
    if not MADE:
        return None
    plan, change = MADE[-1], graph_change(modes, previous, mode)
    graphs = "" if change is None else (
        f"the prefill graphs {'take' if change >= 0 else 'free'} {abs(change) / MiB:,.0f} MiB"
        f"{' more' if change >= 0 else ''} against {previous} (forecast); ")
    return (f"sglang_bcg: memory plan after the switch to {mode}: {graphs}KV {plan.kv_tokens} tokens as planned, "
            f"free {g(free)} (planned: eager and margin {g(plan.reserve)})")
