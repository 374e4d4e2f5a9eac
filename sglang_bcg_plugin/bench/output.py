"""Render bench rows: a table, ``bench.json`` and ``bench.png``."""

from __future__ import annotations

import datetime
import json
import math
from pathlib import Path
from typing import Any

import torch

from .._version import __version__
from .rows import BenchRow

MIB = 1024 * 1024

#: Footnote of the table when timings come from the eager engine (CPU).
CPU_TIMING_NOTE = (
    "n/m: not meaningful on CPU (eager engine, no graphs: replay and capture times swing "
    "between runs; see each row's replay_ms_min/max in bench.json)"
)
#: Keys of ``ratios()`` that compare timings.
TIMING_RATIOS = ("replay_on_over_off", "capture_on_over_off")
#: One line printed instead of writing bench.png when matplotlib is missing.
PLOT_SKIPPED = (
    "plot skipped: matplotlib is not installed; for bench.png install the [bench] extra "
    "(from a checkout: pip install -e '.[bench]')"
)


def sig2(value: float) -> str:
    """``value`` with two significant digits, without exponent: 0.12, 1.1, 90, 1600."""
    if value == 0 or not math.isfinite(value):
        return f"{value:.0f}"
    rounded = round(value, 1 - math.floor(math.log10(abs(value))))
    if abs(rounded) >= 10:
        return f"{rounded:.0f}"
    return f"{rounded:.{1 - math.floor(math.log10(abs(rounded)))}f}"


def _mib(v: int | None) -> str:
    return "-" if v is None else f"{v / MIB:,.1f}"


def ratios(rows: list[BenchRow], *, timings_meaningful: bool = True) -> dict[str, dict[str, float | None]]:
    """Per backend: sharing-on / sharing-off ratios of graph memory, replay and capture time.

    :param timings_meaningful: ``False`` on CPU: the timing ratios are ``None`` (the table's
        ``n/m``, ``null`` in ``bench.json``).
    """
    out: dict[str, dict[str, float | None]] = {}
    by = {(r.backend, r.variant): r for r in rows}
    for backend in dict.fromkeys(r.backend for r in rows):
        on, off = by.get((backend, "on")), by.get((backend, "off"))
        if on is None or off is None:
            continue
        mem = None
        if on.graph_memory_bytes is not None and off.graph_memory_bytes:
            mem = on.graph_memory_bytes / off.graph_memory_bytes
        out[backend] = {
            "graph_memory_on_over_off": mem,
            "resident_on_over_off": on.resident_output_bytes / off.resident_output_bytes if off.resident_output_bytes else None,
            "replay_on_over_off": on.replay_ms / off.replay_ms if off.replay_ms else None,
            "capture_on_over_off": on.capture_s / off.capture_s if off.capture_s else None,
        }
        if not timings_meaningful:
            out[backend].update(dict.fromkeys(TIMING_RATIOS))
    return out


def format_table(rows: list[BenchRow], *, timings_meaningful: bool = True) -> str:
    """The rows as a text table, then the on/off ratios per backend.

    :param timings_meaningful: ``False`` on CPU: timing ratios print as ``n/m`` with a footnote.
    """
    head = ["backend", "variant", "sizes", "max_tokens", "resident MiB", "logical MiB", "graph MiB", "bridges MiB", "capture s", "compile s", "replay ms", "max abs err", "fallbacks"]
    body = [
        [
            r.backend,
            r.variant,
            str(r.num_sizes),
            str(r.max_tokens),
            _mib(r.resident_output_bytes),
            _mib(r.logical_output_bytes),
            _mib(r.graph_memory_bytes),
            _mib(r.bridge_bytes),
            f"{r.capture_s:.2f}",
            "-" if r.compile_s is None else f"{r.compile_s:.2f}",
            f"{r.replay_ms:.3f}",
            "-" if r.max_abs_err is None else f"{r.max_abs_err:.3g}",
            str(r.fallbacks),
        ]
        for r in rows
    ]
    widths = [max(len(c) for c in col) for col in zip(head, *body)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in [head, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    rs_all = ratios(rows, timings_meaningful=timings_meaningful)
    for backend, rs in rs_all.items():
        parts = [
            f"{k.replace('_on_over_off', '')} on/off " + ("n/m" if v is None else f"{v:.3f}")
            for k, v in rs.items()
            if v is not None or (k in TIMING_RATIOS and not timings_meaningful)
        ]
        lines.append(f"{backend}: " + ", ".join(parts))
    if rs_all and not timings_meaningful:
        lines.append(CPU_TIMING_NOTE)
    return "\n".join(lines)


def write_json(
    path: Path, device: str, config: dict[str, Any], rows: list[BenchRow], *, timings_meaningful: bool = True
) -> None:
    """``bench.json``: versions, UTC timestamp, config, rows (with per-size rows), ratios (the
    timing ratios ``null`` when not ``timings_meaningful``, as the table's ``n/m``)."""
    doc = {
        "package_version": __version__,
        "torch_version": torch.__version__,
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device,
        "timings_meaningful": timings_meaningful,
        "config": config,
        "rows": [r.to_dict() for r in rows],
        "ratios": ratios(rows, timings_meaningful=timings_meaningful),
    }
    path.write_text(json.dumps(doc, indent=2) + "\n")


def write_plot(
    path: Path, device: str, config: dict[str, Any], rows: list[BenchRow], *, timings_meaningful: bool = True
) -> bool:
    """Write ``bench.png``; ``False`` (nothing written) when matplotlib is not installed.

    Replay bars carry min–max error bars; on CPU (``timings_meaningful=False``) their title
    says they are not meaningful.
    """
    try:
        import matplotlib
    except ImportError:
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    backends = list(dict.fromkeys(r.backend for r in rows))
    variants = list(dict.fromkeys(r.variant for r in rows))
    by = {(r.backend, r.variant): r for r in rows}
    use_graph = all(r.graph_memory_bytes is not None for r in rows)
    colors = {
        "off": "#c0504d", "on": "#4f81bd", "floor": "#9bbb59", "guard": "#8064a2", "inductor": "#f79646",
        "reference": "#4bacc6", "released": "#77933c", "adopt": "#95b3d7", "reserve": "#1f497d",
    }
    fig, (ax_mem, ax_rep) = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / max(len(variants), 1)
    for i, variant in enumerate(variants):
        xs, mem, rep, spread = [], [], [], []
        for j, backend in enumerate(backends):
            r = by.get((backend, variant))
            if r is None:
                continue
            xs.append(j + (i - (len(variants) - 1) / 2) * width)
            mem.append((r.graph_memory_bytes if use_graph else r.resident_output_bytes) / MIB)  # type: ignore[operator]
            rep.append(r.replay_ms)
            lo, hi = min(r.replay_ms_min, r.replay_ms), max(r.replay_ms_max, r.replay_ms)
            spread.append((r.replay_ms - lo, hi - r.replay_ms))
        label = {
            "off": "sharing off",
            "on": "sharing on",
            "floor": "outputs released (floor)",
            "guard": "sharing on + stale-output guard",
            "inductor": "sharing on, Inductor-compiled",
            "released": "outputs released (zero-copy)",
            "adopt": "sharing on, buffer adopted",
            "reserve": "sharing on, buffer reserved",
            "reference": "torch.compile reduce-overhead (Graph Trees)",
        }.get(variant, variant)
        bars = ax_mem.bar(xs, mem, width, label=label, color=colors.get(variant))
        ax_mem.bar_label(bars, labels=[sig2(v) for v in mem], fontsize=8)
        yerr = [[lo for lo, _ in spread], [hi for _, hi in spread]]
        ax_rep.bar(xs, rep, width, label=label, color=colors.get(variant), yerr=yerr, capsize=3)
    for ax in (ax_mem, ax_rep):
        ax.set_xticks(range(len(backends)), backends)
    ax_mem.set_ylabel("graph pool memory (MiB)" if use_graph else "resident output memory (MiB)")
    ax_mem.set_title("Memory held by captured graphs" if use_graph else "Output memory held (eager engine)")
    ax_rep.set_ylabel(f"replay at {config.get('max_tokens')} tokens (ms, median)")
    ax_rep.set_title("Replay time at the largest size" + ("" if timings_meaningful else " (CPU: not meaningful)"))
    top = max((b.get_height() for b in ax_mem.patches), default=0.0)
    ax_mem.set_ylim(0, top * 1.35 if top > 0 else 1.0)
    ax_mem.legend(fontsize=8, loc="upper left", ncol=2)
    fig.suptitle(
        f"sglang-bcg bench on {device}: {config.get('layers')} layers, hidden {config.get('hidden')}, "
        f"{config.get('dtype')}, {config.get('num_sizes')} sizes up to {config.get('max_tokens')} tokens",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")  # path may be a temporary name
    plt.close(fig)
    return True
