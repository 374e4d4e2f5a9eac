"""``sglang-bcg bench`` arguments, checked (cheapest first, ``--out`` last) and resolved before
any benchmark work; every problem is a ``UsageError`` saying what to do."""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from .._constants import ENV_SHARE_OUTPUT
from ..output.mode import parse_mode
from .budget import check_fits
from .outdir import check_out_dir
from .runner import GRAPH_TREES, VARIANTS, eager_note, runs
from .sizes import MIN_CAPTURE_SIZE, capture_size_stats, prefill_capture_sizes
from .usage import UsageError, shown
from .workload import WORKLOADS, ModelShape, Workload

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
#: The largest ``--max-tokens`` accepted before the memory check (2**40 tokens).
MAX_TOKENS_LIMIT = 1 << 40


class BenchConfig(NamedTuple):
    """A validated ``sglang-bcg bench`` run."""

    device: str
    device_name: str
    backends: list[str]
    variants: list[str]
    workload: Workload
    sizes: list[int]
    repeats: int
    out: Path | None
    progress: bool
    notes: list[str]

    @property
    def gpu(self) -> bool:
        return self.device.startswith("cuda")

    def summary(self) -> dict[str, Any]:
        """The ``config`` object of ``bench.json``."""
        shape = {k: v for k, v in vars(self.workload.shape).items() if k != "device"}  # hidden ... dtype
        return {
            "model": self.workload.name, **shape, "dtype": str(shape["dtype"]).removeprefix("torch."),
            "max_tokens": max(self.sizes), "num_sizes": len(self.sizes), "repeats": self.repeats,
            "backends": self.backends, "variants": self.variants, "torch": torch.__version__,
        }


def _device(raw: str | None) -> str:
    if raw is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device := raw.strip().lower(), flags=re.ASCII):  # any case, as every flag
        raise UsageError(f"--device {shown(raw)} is not supported; use cpu, cuda or cuda:N")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            msg = f"--device {device} but CUDA is not available to torch {torch.__version__}; use --device cpu"
            raise UsageError(msg)
        count = torch.cuda.device_count()
        if int(device.partition(":")[2] or 0) >= count:
            msg = f"--device {device}: this machine has {count} CUDA device(s); use cuda:0 to cuda:{count - 1}"
            raise UsageError(msg)
    return device


def _names(flag: str, raw: str, choices: Iterable[str]) -> list[str]:
    """Comma-separated names, any case: none empty, none twice, all known."""
    choices = list(choices)
    hint = f"give a comma-separated list of: {', '.join(choices)}"
    if not raw.strip():
        raise UsageError(f"{flag} is empty; {hint}")
    entries = [n.strip() for n in raw.split(",")]
    if "" in entries:
        raise UsageError(f"{flag} {shown(raw)} has an empty entry; {hint}")
    words = {c.lower(): c for c in reversed(choices)}  # two names differing in case: the first listed
    names = [n if n in choices else words.get(n.lower(), n) for n in entries]  # as spelled in choices; else as given
    if twice := sorted({n for n in names if names.count(n) > 1}):
        msg = f"{flag} {shown(raw)} lists {shown(', '.join(twice), quote=False)} more than once; give each once"
        raise UsageError(msg)
    if bad := sorted(set(names) - set(choices)):
        raise UsageError(f"unknown {flag.removeprefix('--')} {shown(bad)}; {hint}")
    return names


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _flag(name: str, value: int, given: object) -> str:
    return f"{name} {value}" + ("" if given else " (default)")


def _check_heads(args: argparse.Namespace, hidden: int, heads: int, kv_heads: int, llama: bool) -> None:
    """Head counts that the model (ours, or transformers' LlamaConfig) accepts."""
    if hidden % heads:
        why = "transformers' LlamaConfig requires it, whatever --head-dim" if llama else "head size = hidden / heads"
        raise UsageError(f"{_flag('--hidden', hidden, args.hidden)} is not a multiple of "
                         f"{_flag('--heads', heads, args.heads)} ({why}); use --heads among {_divisors(hidden)}")
    if not llama and args.head_dim is not None:
        msg = "--head-dim applies to --model llama only (the synthetic decoder's head size is hidden / heads)"
        raise UsageError(msg)
    if heads % kv_heads:
        kv = _flag("--kv-heads", kv_heads, args.kv_heads)
        raise UsageError(f"{_flag('--heads', heads, args.heads)} is not a multiple of {kv} (grouped-query attention); "
                         f"use --kv-heads among {_divisors(heads)}")


def _model(args: argparse.Namespace, device: str) -> ModelShape:
    gpu = device.startswith("cuda")
    llama = args.model == "llama"
    hidden = args.hidden or (2880 if gpu else (64 if llama else 128))
    heads = args.heads or ((64 if llama else 45) if gpu else 4)
    kv_heads = args.kv_heads or ((8 if llama else 5) if gpu else 2)
    _check_heads(args, hidden, heads, kv_heads, llama)
    head_dim = args.head_dim or ((64 if gpu else 16) if llama else hidden // heads)
    if llama and head_dim % 2:
        raise UsageError(f"--head-dim {head_dim} is odd; transformers' rotary embedding rotates the two halves of each "
                         f"head, so it needs an even head size: use --head-dim {head_dim + 1}")
    return ModelShape(hidden=hidden, layers=args.layers or (4 if gpu else 2), heads=heads, kv_heads=kv_heads,
                      head_dim=head_dim, intermediate=args.intermediate or hidden,
                      dtype=DTYPES[args.dtype or ("bfloat16" if gpu else "float32")], device=device)


def _or(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def _variant_rows(backends: list[str], variants: list[str], available: list[str]) -> list[str]:
    """``note:`` lines for backends that skip a variant. :raises UsageError: no backend runs one."""
    if not (ours := [b for b in backends if b != GRAPH_TREES]):
        return []
    if unrun := [v for v in variants if not any(runs(b, v) for b in ours)]:
        by = [b for b in available if b != GRAPH_TREES and runs(b, unrun[0])]
        what = ", ".join(unrun)
        raise UsageError(f"--variants {what} {'is' if len(unrun) == 1 else 'are'} run only by --backends {_or(by)}, "
                         f"and --backends {','.join(backends)} has none of them: add {_or(by)} to --backends or drop "
                         f"{what} from --variants")
    skipped = {b: ", ".join(v for v in variants if not runs(b, v)) for b in ours}
    return [f"note: {b} does not run --variants {s} (no compiled callable): no row for it"
            for b, s in skipped.items() if s]


def build_config(args: argparse.Namespace, available_backends: list[str]) -> BenchConfig:
    """Check every ``bench`` argument (and the environment) and resolve the defaults.
    :raises UsageError: the first problem found."""
    device = _device(args.device)
    gpu = device.startswith("cuda")
    backends = _names("--backends", args.backends, available_backends)
    variants = _names("--variants", args.variants or ("off,on,floor,guard" if gpu else "off,on,released"), VARIANTS)
    notes = _variant_rows(backends, variants, available_backends)
    if not gpu and any(b != GRAPH_TREES for b in backends):  # the eager engine: what each variant runs as
        notes += [note for note in map(eager_note, variants) if note is not None]
    try:
        env = parse_mode(os.environ.get(ENV_SHARE_OUTPUT), ENV_SHARE_OUTPUT, text=True)
    except ValueError as exc:
        raise UsageError(f"{exc} (or unset it: bench sets sharing per --variants)") from None
    if env is not None:
        notes.append(f"note: {ENV_SHARE_OUTPUT} does not apply: bench sets sharing per --variants "
                     f"({','.join(variants)})")
    model = _model(args, device)
    workload = WORKLOADS[args.model](model)  # llama without transformers: a UsageError naming the extra
    max_tokens = args.max_tokens or (16384 if gpu else (64 if args.model == "llama" else 256))
    if max_tokens < MIN_CAPTURE_SIZE:
        raise UsageError(f"--max-tokens {max_tokens} is below {MIN_CAPTURE_SIZE}, the smallest prefill capture size; "
                         f"use --max-tokens {MIN_CAPTURE_SIZE} or more")
    if max_tokens > MAX_TOKENS_LIMIT:
        msg = (f"--max-tokens {shown(max_tokens)} is beyond any machine's memory (at most {MAX_TOKENS_LIMIT} is "
               "accepted); SGLang captures prefill up to 16384 tokens by default: use --max-tokens 16384 or less")
        raise UsageError(msg)
    if (largest := capture_size_stats(max_tokens).largest) != max_tokens:
        notes.append(f"note: --max-tokens {max_tokens} is not one of SGLang's prefill capture "
                     f"sizes; the largest below it, {largest}, is captured")
    check_fits(model, max_tokens, variants, backends=backends, workload=args.model)
    out = None if args.out is None else check_out_dir(args.out)
    return BenchConfig(device=device, device_name=torch.cuda.get_device_name(device) if gpu else "cpu",
                       backends=backends, variants=variants, workload=workload, sizes=prefill_capture_sizes(max_tokens),
                       repeats=args.repeats or (50 if gpu else 10), out=out, progress=not args.no_progress, notes=notes)
