"""Render bench rows: a table, ``bench.json`` and ``bench.png``."""

from __future__ import annotations

import datetime
import json
import math
from pathlib import Path
from typing import Any, NamedTuple

import torch

from .._version import __version__
from .runner import GRAPH_TREES, VARIANTS, BenchRow

MIB = 1024 * 1024

#: Footnote of the table when timings come from the eager engine (CPU).
CPU_TIMING_NOTE = ("n/m: not meaningful on CPU (eager engine, no graphs: replay and capture times swing "
                   "between runs; see each row's replay_ms_min/max in bench.json)")
#: Keys of ``ratios()`` that compare timings.
TIMING_RATIOS = ("replay_on_over_off", "capture_on_over_off")
#: One line printed instead of writing bench.png when matplotlib is missing.
PLOT_SKIPPED = ("plot skipped: matplotlib is not installed; for bench.png install the [bench] extra "
                "(from a checkout: pip install -e '.[bench]')")


def sig2(value: float) -> str:
    """``value`` with two significant digits, without exponent: 0.12, 1.1, 90, 1600."""
    if value == 0 or not math.isfinite(value):
        return f"{value:.0f}"
    rounded = round(value, 1 - math.floor(math.log10(abs(value))))
    if abs(rounded) >= 10:
        return f"{rounded:.0f}"
    return f"{rounded:.{1 - math.floor(math.log10(abs(rounded)))}f}"


def _cell(v: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if v is None else format(v * scale, spec)


def _mib(v: int | None) -> str:
    return _cell(v, ",.1f", 1 / MIB)


def _ratio(on: float | None, off: float | None) -> float | None:
    return on / off if on is not None and off else None


def ran_as_note(r: BenchRow) -> str:
    """What a row's variant ran as on the eager engine, and why (empty when it ran as itself)."""
    return "" if r.ran_as is None else f"ran as {r.ran_as} ({r.ran_as_reason})"


def row_line(r: BenchRow) -> str:
    """One line for the progress log (the table has everything)."""
    forecast = "" if r.forecast_bytes is None else f", forecast {_mib(r.forecast_bytes)} MiB"
    ran = "" if r.ran_as is None else f"{ran_as_note(r)}: "
    return (f"{ran}resident {r.resident_output_bytes / MIB:,.2f} MiB, graph {_mib(r.graph_memory_bytes)} MiB, bridges "
            f"{_mib(r.bridge_bytes)} MiB, capture {r.capture_s:.2f} s, replay {r.replay_ms:.3f} ms, max abs err "
            f"{_cell(r.max_abs_err, '.3g')}, fallbacks {r.fallbacks}{forecast}")


def ratios(rows: list[BenchRow], *, timings_meaningful: bool = True) -> dict[str, dict[str, float | None]]:
    """Per backend: sharing-on / sharing-off ratios (the timing ones ``None`` unless meaningful)."""
    offs = {r.backend: r for r in rows if r.variant == "off"}
    ons = {r.backend: r for r in rows if r.variant == "on" and r.backend in offs}
    return {backend: {
        "graph_memory_on_over_off": _ratio(on.graph_memory_bytes, offs[backend].graph_memory_bytes),
        "resident_on_over_off": _ratio(on.resident_output_bytes, offs[backend].resident_output_bytes),
        "replay_on_over_off": _ratio(on.replay_ms, offs[backend].replay_ms) if timings_meaningful else None,
        "capture_on_over_off": _ratio(on.capture_s, offs[backend].capture_s) if timings_meaningful else None,
    } for backend, on in ons.items()}


def format_table(rows: list[BenchRow], *, timings_meaningful: bool = True) -> str:
    """The rows as a text table, then the on/off ratios per backend."""
    head = ["backend", "variant", "sizes", "max_tokens", "resident MiB", "logical MiB", "graph MiB", "forecast MiB", "error %", "bridges MiB", "capture s", "compile s", "replay ms", "max abs err", "fallbacks"]
    body = [
        [r.backend, r.variant + ("*" if r.ran_as is not None else ""), str(r.num_sizes), str(r.max_tokens), *map(_mib, (
            r.resident_output_bytes, r.logical_output_bytes, r.graph_memory_bytes, r.forecast_bytes)),
         _cell(r.forecast_error, "+.1f", 100), _mib(r.bridge_bytes), f"{r.capture_s:.2f}", _cell(r.compile_s, ".2f"),
         f"{r.replay_ms:.3f}", _cell(r.max_abs_err, ".3g"), str(r.fallbacks)]
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
    ran = {r.variant: ran_as_note(r) for r in rows if r.ran_as is not None}
    lines.extend(f"{variant}*: {note}" for variant, note in ran.items())
    return "\n".join(lines)


def write_json(
    path: Path, device: str, config: dict[str, Any], rows: list[BenchRow], *, timings_meaningful: bool = True,
    cold: dict[str, Any] | None = None,
) -> None:
    """``bench.json``: versions, UTC timestamp, config, rows (with per-size rows), ratios, and ``cold``
    (:func:`~.runner.cold_summary`)."""
    doc = {
        "package_version": __version__, "torch_version": torch.__version__,
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "device": device,
        "timings_meaningful": timings_meaningful, "config": config, "rows": [r.to_dict() for r in rows],
        "ratios": ratios(rows, timings_meaningful=timings_meaningful), "cold": cold,
    }
    path.write_text(json.dumps(doc, indent=2) + "\n")


#: The metrics of every bar of ``bench.png``, one panel each, in panel order.
PLOT_METRICS = ("memory_mib", "replay_ms")
#: The reference row's color (each variant's: ``VARIANTS``).
REFERENCE_COLOR = "#4bacc6"
#: Graph Trees' legend label: torch's own CUDA graphs (on CPU the same compile, without graphs).
GRAPH_TREES_LABEL = "torch's CUDA Graph Trees (torch.compile reduce-overhead)"
FORECAST_LABEL = "forecast before capture (CaptureBackend.forecast)"
GRAPH_TREES_CPU_LABEL = "torch.compile without mode (CPU stand-in: Graph Trees need CUDA)"
#: Caption under the plot when Graph Trees' resident-output bar is left out (CPU).
NO_RESIDENT_CAPTION = ("graph-trees: no memory bar: resident output does not apply (Graph Trees keep no output "
                       "past the next step); graph memory is measured on CUDA only")


class PlotBar(NamedTuple):
    """One bar per panel: a row's ``values`` (``PLOT_METRICS`` keys; ``None``: the metric does
    not apply, no bar is drawn) and its replay spread (below, above the median)."""

    variant: str
    label: str
    values: dict[str, float | None]
    replay_spread: tuple[float, float]
    forecast_mib: float | None = None  # the forecast made before capture (graph memory only)


class PlotGroup(NamedTuple):
    """The bars of one backend, side by side; ``reference``: torch's Graph Trees, its own group."""

    backend: str
    tick: str
    reference: bool
    bars: list[PlotBar]


def _bar(row: BenchRow, graph_memory: bool) -> PlotBar:
    reference = row.backend == GRAPH_TREES  # resident output: Graph Trees hold none past the next step
    held = row.graph_memory_bytes if graph_memory else None if reference else row.resident_output_bytes
    label = (GRAPH_TREES_LABEL if graph_memory else GRAPH_TREES_CPU_LABEL) if reference else VARIANTS[row.variant].label
    lo, hi = min(row.replay_ms_min, row.replay_ms), max(row.replay_ms_max, row.replay_ms)
    values = {"memory_mib": None if held is None else held / MIB, "replay_ms": row.replay_ms}
    forecast = row.forecast_bytes / MIB if graph_memory and row.forecast_bytes is not None else None
    return PlotBar(row.variant, label, values, (row.replay_ms - lo, hi - row.replay_ms), forecast)


def plot_groups(rows: list[BenchRow], *, graph_memory: bool) -> list[PlotGroup]:
    """``bench.png``'s bar groups: one per backend of ours, in row order, then Graph Trees' own;
    ``graph_memory``: the memory panel shows graph memory (CUDA), else resident output memory."""
    backends = sorted(dict.fromkeys(r.backend for r in rows), key=lambda b: b == GRAPH_TREES)  # stable: GT last
    return [
        PlotGroup(b, "graph-trees\n(torch's CUDA\nGraph Trees)" if b == GRAPH_TREES else b, b == GRAPH_TREES,
                  [_bar(r, graph_memory) for r in rows if r.backend == b])
        for b in backends
    ]


def _draw(axes: dict[str, Any], groups: list[PlotGroup]) -> bool:
    """Draw every group's bars on ``axes`` (one per ``PLOT_METRICS`` key); ``True``: one left out."""
    width = 0.8 / max((len(g.bars) for g in groups), default=1)
    seen: set[str] = set()
    left_out = False
    for j, group in enumerate(groups):
        for i, bar in enumerate(group.bars):
            x = j + (i - (len(group.bars) - 1) / 2) * width
            color = REFERENCE_COLOR if group.reference else VARIANTS[bar.variant].color
            style = {"color": color, "hatch": "//" if group.reference else None,
                     "edgecolor": "white" if group.reference else None,
                     "label": bar.label if bar.label not in seen else "_nolegend_"}
            seen.add(bar.label)
            for metric, ax in axes.items():
                value = bar.values[metric]
                if value is None:
                    ax.annotate("n/a\n(see below)", (x, 0), ha="center", va="bottom", fontsize=8, color="#555555")
                    left_out = True
                    continue
                yerr = [[bar.replay_spread[0]], [bar.replay_spread[1]]] if metric == "replay_ms" else None
                drawn = ax.bar([x], [value], width, yerr=yerr, capsize=3, **style)
                if metric == "memory_mib":  # upright labels overlap once a group has five bars
                    ax.bar_label(drawn, labels=[sig2(value)], fontsize=8, rotation=90 if width < 0.18 else 0)
                    if bar.forecast_mib is not None:  # the forecast made before the capture
                        ax.plot([x - width / 2, x + width / 2], [bar.forecast_mib] * 2, color="black", linewidth=1.5,
                                label=FORECAST_LABEL if "forecast" not in seen else "_nolegend_")
                        seen.add("forecast")
    return left_out


def write_plot(
    path: Path, device: str, config: dict[str, Any], rows: list[BenchRow], *, timings_meaningful: bool = True
) -> bool:
    """Write ``bench.png`` (memory and replay panels); ``False`` when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    use_graph = all(r.graph_memory_bytes is not None for r in rows)
    groups = plot_groups(rows, graph_memory=use_graph)
    fig, (ax_mem, ax_rep) = plt.subplots(1, 2, figsize=(12, 5.2))
    left_out = _draw({"memory_mib": ax_mem, "replay_ms": ax_rep}, groups)
    for ax in (ax_mem, ax_rep):
        ax.set_xticks(range(len(groups)), [g.tick for g in groups])
        ax.set_xlim(-0.5, len(groups) - 0.5)  # a group without a bar keeps its place
        if groups and groups[-1].reference and len(groups) > 1:
            ax.axvline(len(groups) - 1.5, color="#888888", linestyle="--", linewidth=0.8)
    ax_mem.set_ylabel("graph pool memory (MiB)" if use_graph else "resident output memory (MiB)")
    ax_mem.set_title("Memory held by captured graphs" if use_graph else "Output memory held (eager engine)")
    ax_rep.set_ylabel(f"replay at {config.get('max_tokens')} tokens (ms, median)")
    ax_rep.set_title("Replay time at the largest size" + ("" if timings_meaningful else " (CPU: not meaningful)"))
    top = max((b.get_height() for b in ax_mem.patches), default=0.0)
    ax_mem.set_ylim(0, top * 1.15 if top > 0 else 1.0)
    # every bar has a replay bar (memory may be left out): the legend comes from the replay panel
    handles, labels = ax_rep.get_legend_handles_labels()
    for handle, label in zip(*ax_mem.get_legend_handles_labels()):
        if label == FORECAST_LABEL:  # drawn on the memory panel only
            handles.append(handle)
            labels.append(label)
    ncol = min(len(labels), 3) or 1
    legend_rows = -(-len(labels) // ncol)
    caption = 0.035 if left_out else 0.0
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8, bbox_to_anchor=(0.5, caption), frameon=False)
    fig.suptitle(f"sglang-bcg bench on {device}: {config.get('layers')} layers, hidden {config.get('hidden')}, "
                 f"{config.get('dtype')}, {config.get('num_sizes')} sizes up to {config.get('max_tokens')} tokens",
                 fontsize=10)
    if left_out:
        fig.text(0.5, 0.01, NO_RESIDENT_CAPTION, ha="center", va="bottom", fontsize=8, style="italic")
    fig.tight_layout(rect=(0, caption + 0.045 * legend_rows, 1, 1))
    fig.savefig(path, dpi=120, format="png")  # path may be a temporary name
    plt.close(fig)
    return True
