"""``sglang-bcg bench`` arguments, checked and resolved before any benchmark work.

Every problem is a :class:`~sglang_bcg_plugin.errors.UsageError` saying what is wrong and what to
do; the CLI prints it as one ``error:`` line. Checks run cheapest first and ``--out`` last, so a
bad argument never leaves a new directory behind.
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .._constants import ENV_SHARE_OUTPUT
from ..errors import UsageError
from ..output_mode import parse_mode_text
from .budget import check_fits
from .workload import WORKLOADS, ModelShape, Workload
from .runner import VARIANTS
from .sizes import MIN_CAPTURE_SIZE, prefill_capture_sizes

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}
_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


@dataclass(frozen=True)
class BenchConfig:
    """A validated ``sglang-bcg bench`` run."""

    device: str
    device_name: str
    backends: list[str]
    variants: list[str]
    model: ModelShape
    workload: Workload
    sizes: list[int]
    repeats: int
    out: Path | None
    progress: bool
    notes: list[str] = field(default_factory=list)

    @property
    def gpu(self) -> bool:
        return self.device.startswith("cuda")

    def summary(self) -> dict[str, Any]:
        """The ``config`` object of ``bench.json``."""
        m = self.model
        return {
            "model": self.workload.name, "hidden": m.hidden, "layers": m.layers, "heads": m.heads,
            "kv_heads": m.kv_heads, "head_dim": m.head_dim,
            "intermediate": m.intermediate, "dtype": str(m.dtype).removeprefix("torch."),
            "max_tokens": max(self.sizes), "num_sizes": len(self.sizes), "repeats": self.repeats,
            "backends": self.backends, "variants": self.variants, "torch": torch.__version__,
        }


def _device(raw: str | None) -> str:
    if raw is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not _DEVICE.fullmatch(raw):
        msg = f"--device {raw!r} is not supported; use cpu, cuda or cuda:N"
        raise UsageError(msg)
    if raw.startswith("cuda"):
        if not torch.cuda.is_available():
            msg = f"--device {raw} but CUDA is not available to torch {torch.__version__}; use --device cpu"
            raise UsageError(msg)
        index = int(raw.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            count = torch.cuda.device_count()
            msg = f"--device {raw}: this machine has {count} CUDA device(s); use cuda:0 to cuda:{count - 1}"
            raise UsageError(msg)
    return raw


def _names(flag: str, raw: str, choices: Iterable[str], *, unknown: str) -> list[str]:
    """Comma-separated names: none empty, none twice, all known."""
    choices = list(choices)
    hint = f"give a comma-separated list of: {', '.join(choices)}"
    if not raw.strip():
        msg = f"{flag} is empty; {hint}"
        raise UsageError(msg)
    names = [n.strip() for n in raw.split(",")]
    if "" in names:
        msg = f"{flag} {raw!r} has an empty entry; {hint}"
        raise UsageError(msg)
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        msg = f"{flag} {raw!r} lists {', '.join(twice)} more than once; give each once"
        raise UsageError(msg)
    bad = sorted(set(names) - set(choices))
    if bad:
        msg = f"{unknown} {bad}; {hint}"
        raise UsageError(msg)
    return names


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _flag(name: str, value: int, given: object) -> str:
    return f"{name} {value}" + ("" if given else " (default)")


def _model(args: argparse.Namespace, device: str) -> ModelShape:
    gpu = device.startswith("cuda")
    llama = args.model == "llama"
    hidden = args.hidden or (2880 if gpu else (64 if llama else 128))
    heads = args.heads or ((64 if llama else 45) if gpu else 4)
    kv_heads = args.kv_heads or ((8 if llama else 5) if gpu else 2)
    if not llama and hidden % heads:
        msg = (
            f"{_flag('--hidden', hidden, args.hidden)} is not a multiple of {_flag('--heads', heads, args.heads)} "
            f"(head size = hidden / heads); use --heads among {_divisors(hidden)}"
        )
        raise UsageError(msg)
    if llama and args.head_dim is None and not gpu and hidden % heads:
        msg = f"{_flag('--hidden', hidden, args.hidden)}: give --head-dim (hidden is not a multiple of --heads {heads})"
        raise UsageError(msg)
    if not llama and args.head_dim is not None:
        msg = "--head-dim applies to --model llama only (the synthetic decoder's head size is hidden / heads)"
        raise UsageError(msg)
    if heads % kv_heads:
        msg = (
            f"{_flag('--heads', heads, args.heads)} is not a multiple of "
            f"{_flag('--kv-heads', kv_heads, args.kv_heads)} (grouped-query attention); "
            f"use --kv-heads among {_divisors(heads)}"
        )
        raise UsageError(msg)
    return ModelShape(
        hidden=hidden,
        layers=args.layers or (4 if gpu else 2),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=args.head_dim or ((64 if gpu else 16) if llama else hidden // heads),
        intermediate=args.intermediate or hidden,
        dtype=DTYPES[args.dtype or ("bfloat16" if gpu else "float32")],
        device=device,
    )


def _sizes(max_tokens: int) -> list[int]:
    if max_tokens < MIN_CAPTURE_SIZE:
        msg = (
            f"--max-tokens {max_tokens} is below {MIN_CAPTURE_SIZE}, the smallest prefill capture size; "
            f"use --max-tokens {MIN_CAPTURE_SIZE} or more"
        )
        raise UsageError(msg)
    return prefill_capture_sizes(max_tokens)


def _out_dir(out: Path) -> Path:
    """Create ``out`` (parents too) and prove it writable, so a bad path fails before the bench."""
    if out.exists() and not out.is_dir():
        msg = f"--out {out} is an existing file; give a directory (bench.json and bench.png are written into it)"
        raise UsageError(msg)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        msg = f"--out {out} is not a writable directory ({exc.strerror or exc}); give one you can write to"
        raise UsageError(msg) from None
    for name in ("bench.json", "bench.png"):
        if (out / name).is_dir():
            msg = f"--out {out}: {out / name} is a directory; remove it or give another --out"
            raise UsageError(msg)
    return out


def _env_notes(variants: list[str]) -> list[str]:
    try:
        value = parse_mode_text(os.environ.get(ENV_SHARE_OUTPUT))
    except ValueError as exc:
        msg = f"{exc} (or unset it: bench sets sharing per --variants)"
        raise UsageError(msg) from None
    if value is None:
        return []
    return [f"note: {ENV_SHARE_OUTPUT} does not apply: bench sets sharing per --variants ({','.join(variants)})"]


def build_config(args: argparse.Namespace, available_backends: list[str]) -> BenchConfig:
    """Check every ``bench`` argument (and the environment) and resolve the defaults.

    :raises UsageError: the first problem found, saying what to do.
    """
    device = _device(args.device)
    gpu = device.startswith("cuda")
    backends = _names("--backends", args.backends, available_backends, unknown="unknown backends")
    default_variants = "off,on,floor,guard" if gpu else "off,on"
    variants = _names("--variants", args.variants or default_variants, VARIANTS, unknown="unknown variants")
    notes = _env_notes(variants)
    model = _model(args, device)
    workload = WORKLOADS[args.model](model)  # llama without transformers: a UsageError naming the extra
    max_tokens = args.max_tokens or (16384 if gpu else (64 if args.model == "llama" else 256))
    sizes = _sizes(max_tokens)
    check_fits(model, sizes, variants, max_tokens)
    out = None if args.out is None else _out_dir(args.out)
    return BenchConfig(
        device=device,
        device_name=torch.cuda.get_device_name(device) if gpu else "cpu",
        backends=backends,
        variants=variants,
        model=model,
        workload=workload,
        sizes=sizes,
        repeats=args.repeats or (50 if gpu else 10),
        out=out,
        progress=not args.no_progress,
        notes=notes,
    )
