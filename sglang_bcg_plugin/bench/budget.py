"""Does a bench run fit in memory? A lower bound of its peak against 90 % of the free device
memory (CPU: physical RAM), before any work (docs/getting-started.md)."""

from __future__ import annotations

import bisect
import operator
import os
from collections.abc import Sequence

import torch

from .runner import VARIANTS
from .sizes import MIN_CAPTURE_SIZE, SizeStats, capture_size_stats
from .usage import UsageError
from .workload import ModelShape

#: Share of the available memory a run may plan to use.
FRACTION = 0.9


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024:
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:,.1f} PiB"


#: Elements the eager segments (CPU) keep per captured token and layer, by workload and backend:
#: the factors of the hidden, query, key/value and MLP widths (fitted: docs/getting-started.md).
TAPE_KEPT: dict[str, dict[str, tuple[float, float, float, float]]] = {
    "synthetic": {"breakable": (6, 2, 2, 3), "piecewise": (0, 2, 2, 0)},
    "llama": {"breakable": (10, 6.5, 6.5, 4), "piecewise": (0, 2, 2, 0)},
}


def tape_kept_bytes(model: ModelShape, sizes: SizeStats, backends: Sequence[str], workload: str = "synthetic") -> int:
    """Bytes the eager segments of the heaviest of ``backends`` keep over every size (CPU)."""
    if model.device.startswith("cuda"):
        return 0
    q, kv = model.heads * model.head_dim, model.kv_heads * model.head_dim
    kept = TAPE_KEPT.get(workload, TAPE_KEPT["synthetic"])
    widths = (model.hidden, q, kv, model.intermediate)
    per_token = max((sum(map(operator.mul, kept[name], widths)) for name in backends if name in kept), default=0)
    return int(per_token * model.layers * sizes.total * model.dtype.itemsize)


def estimate_bytes(model: ModelShape, sizes: SizeStats | list[int], variants: list[str], *,
                   backends: Sequence[str] = (), workload: str = "synthetic") -> int:
    """Peak bytes of the heaviest of ``backends`` x ``variants`` capturing ``sizes`` (or their stats)."""
    if not isinstance(sizes, SizeStats):
        sizes = SizeStats(len(sizes), sum(sizes), max(sizes))
    b, h, inter, t = model.dtype.itemsize, model.hidden, model.intermediate, sizes.largest
    q, kv = model.heads * model.head_dim, model.kv_heads * model.head_dim
    weights = model.layers * ((q + 2 * kv) * h + h * q + 3 * inter * h) * b
    if "off" in variants:
        outputs = sizes.total * h * b  # every key keeps its own output
    elif any(VARIANTS[v].share is True for v in variants if v in VARIANTS):
        outputs = t * h * b  # sharing on (on, guard, adopt, packed, inductor...): one buffer per leaf
    else:
        outputs = 0  # floor, released: outputs left in graph memory
    # live at once in one layer: residual, normed input, qkv, k/v repeated, attention (2x),
    # o_proj, gate_up (2x), the activation
    activations = t * b * (4 * h + 2 * kv + 4 * q + 3 * inter)
    # the capture's own forwards: one more forward's activations, or every size's tape
    kept = max(activations, tape_kept_bytes(model, sizes, backends, workload))
    return weights + t * h * b + outputs + activations + kept


def available_bytes(device: str) -> tuple[int, str] | None:
    """Bytes a run may use on ``device`` and where they are; ``None`` when unknown."""
    if device.startswith("cuda"):
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free), f"{device} has {human_bytes(free)} free"
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows) or no such name
        return None
    return int(total), f"this machine has {human_bytes(total)} of RAM"


def check_fits(model: ModelShape, max_tokens: int, variants: list[str], *, backends: Sequence[str] = (),
               workload: str = "synthetic") -> None:
    """:raises UsageError: the estimate for ``max_tokens`` exceeds the available memory."""
    if (found := available_bytes(model.device)) is None:
        return
    limit, where = int(found[0] * FRACTION), found[1]

    def need(n: int) -> int:
        return estimate_bytes(model, capture_size_stats(n), variants, backends=backends, workload=workload)

    stats = capture_size_stats(max_tokens)
    if need(max_tokens) <= limit:
        return
    below = range(MIN_CAPTURE_SIZE, stats.largest)
    fitting = bisect.bisect_right(below, limit, key=need)  # how many fit: the estimate grows with max_tokens
    best = capture_size_stats(below[fitting - 1]).largest if fitting else None
    todo = f"use --max-tokens {best} or less" if best is not None else "lower --hidden, --layers or --intermediate"
    tape = tape_kept_bytes(model, stats, backends, workload)
    kept = f", {human_bytes(tape)} the eager segments keep of every size" if tape else ""
    sizes = f"{stats.num} capture size{'' if stats.num == 1 else 's'}"
    raise UsageError(f"--max-tokens {max_tokens} needs at least {human_bytes(need(max_tokens))} ({sizes}: weights, "
                     f"inputs, captured outputs, activations of the largest{kept}) but {where}; {todo}")
