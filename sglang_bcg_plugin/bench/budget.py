"""Does a bench run fit in memory? An estimate of its peak, checked before any work.

The estimate is a lower bound of what one variant holds at its peak (variants run one after
the other, each cleaned up): the weights, the static input, the captured outputs (every size's
own output with sharing off, one max-size buffer with sharing on, none for ``floor``) and two
forwards' activations at the largest size (the capture's and the eager reference's). It is
compared with 90 % of the free memory of the CUDA device (``torch.cuda.mem_get_info``) or of
this machine's physical RAM on CPU. A run that passes can still run out of memory; one that
fails would certainly have, after minutes of capturing. The estimate needs only the count, sum
and largest of the capture sizes (:func:`~.sizes.capture_size_stats`), so a ``--max-tokens`` of
any size is checked without building its size list.
"""

from __future__ import annotations

import os

import torch

from .runner import VARIANTS
from .usage import UsageError
from .workload import ModelShape
from .sizes import MIN_CAPTURE_SIZE, SizeStats, capture_size_stats
from .text import plural

#: Share of the available memory a run may plan to use.
FRACTION = 0.9


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024:
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:,.1f} PiB"


def estimate_bytes(model: ModelShape, sizes: SizeStats | list[int], variants: list[str]) -> int:
    """Peak bytes of the heaviest of ``variants`` capturing ``sizes`` (see the module doc).

    :param sizes: the capture sizes, or their :class:`~.sizes.SizeStats`.
    """
    if not isinstance(sizes, SizeStats):
        sizes = SizeStats(len(sizes), sum(sizes), max(sizes))
    b = torch.empty((), dtype=model.dtype).element_size()
    h, inter = model.hidden, model.intermediate
    q = model.heads * model.head_dim
    kv = model.kv_heads * model.head_dim
    t = sizes.largest
    weights = model.layers * ((q + 2 * kv) * h + h * q + 3 * inter * h) * b
    if "off" in variants:
        outputs = sizes.total * h * b  # every key keeps its own output
    elif any(VARIANTS[v].share is True for v in variants if v in VARIANTS):
        outputs = t * h * b  # sharing on (on, guard, adopt, packed, inductor...): one buffer per leaf
    else:
        outputs = 0  # floor, released: outputs left in graph memory
    # Live at once in one layer: residual, normed input, qkv, k/v repeated to all heads, the
    # attention output and its copy, o_proj, gate_up (2x), the activation.
    activations = t * b * (4 * h + 2 * kv + 4 * q + 3 * inter)
    return weights + t * h * b + outputs + 2 * activations


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


def _largest_fitting(model: ModelShape, below: int, variants: list[str], limit: int) -> int | None:
    """The largest ``--max-tokens`` below ``below`` whose estimate is within ``limit``."""
    lo, hi = MIN_CAPTURE_SIZE, below - 1
    if hi < lo or estimate_bytes(model, capture_size_stats(lo), variants) > limit:
        return None
    while lo < hi:  # the estimate grows with max_tokens
        mid = (lo + hi + 1) // 2
        if estimate_bytes(model, capture_size_stats(mid), variants) <= limit:
            lo = mid
        else:
            hi = mid - 1
    return capture_size_stats(lo).largest


def check_fits(model: ModelShape, max_tokens: int, variants: list[str]) -> None:
    """:param max_tokens: the ``--max-tokens`` asked for (its sizes are never built here).
    :raises UsageError: the estimate exceeds the available memory (says what would fit)."""
    found = available_bytes(model.device)
    if found is None:
        return
    avail, where = found
    limit = int(avail * FRACTION)
    stats = capture_size_stats(max_tokens)
    need = estimate_bytes(model, stats, variants)
    if need <= limit:
        return
    best = _largest_fitting(model, stats.largest, variants, limit)
    todo = (
        f"use --max-tokens {best} or less" if best is not None else "lower --hidden, --layers or --intermediate"
    )
    msg = (
        f"--max-tokens {max_tokens} needs at least {human_bytes(need)} ({plural(stats.count, 'capture size')}: "
        f"weights, inputs, captured outputs, activations of the largest) but {where}; {todo}"
    )
    raise UsageError(msg)
