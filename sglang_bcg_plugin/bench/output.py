"""Render bench rows: a table, ``bench.json`` and ``bench.png``."""

from __future__ import annotations

import datetime
import json
import math
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from .._version import __version__
from .runner import GRAPH_TREES, VARIANTS, BenchRow

MIB = 1024 * 1024

#: The widest line :func:`format_table` prints: a terminal's (the detail stays in bench.json).
TABLE_WIDTH = 120
#: Under the table on CPU: what the CPU cannot measure and where the GPU figures are.
CPU_NOTE = (
    "CPU: the eager engine, no CUDA graphs. Graph memory, its forecast and CUDA-graph replay speed cannot be\n"
    "measured here: 'resident MiB' is the output memory each mode keeps; capture and replay times are eager CPU\n"
    "times, not CUDA-graph replay (they swing between runs; bench.json keeps each row's spread). 'released' keeps\n"
    "outputs here as 'off' does (no graph pool to release them into): what it saves is graph-pool memory.\n"
    "GPU figures (H200, a real SGLang server): docs/benchmarks.md"
)
#: Under the table where Graph Trees has a row.
GRAPH_TREES_NOTE = "graph-trees: resident n/a (Graph Trees keep no output past the next step)"
#: ``ratios()``' keys and the row fields they compare; :data:`TIMING_RATIOS` are the timing ones.
RATIO_FIELDS = {"graph_memory_on_over_off": "graph_memory_bytes", "resident_on_over_off": "resident_output_bytes",
                "replay_on_over_off": "replay_ms", "capture_on_over_off": "capture_s"}
TIMING_RATIOS = ("replay_on_over_off", "capture_on_over_off")
#: One line printed instead of writing bench.png when matplotlib is missing.
PLOT_SKIPPED = ("plot skipped: matplotlib is not installed; for bench.png install the [bench] extra "
                "(from a checkout: pip install -e '.[bench]')")
#: The metrics a row saves against ``off``: graph memory where measured (CUDA), else resident output.
GRAPH, RESIDENT = "graph_memory_bytes", "resident_output_bytes"
MINUS, ELLIPSIS = "\N{MINUS SIGN}", "\N{HORIZONTAL ELLIPSIS}"
#: After the variant of a row that ran as another (:func:`ran_as_note`), with a footnote under the table.
STAR = "*"


def sig2(value: float) -> str:
    """``value`` with two significant digits, without exponent: 0.12, 1.1, 90, 1600."""
    if value == 0 or not math.isfinite(value):
        return f"{value:.0f}"
    rounded = round(value, 1 - math.floor(math.log10(abs(value))))
    return f"{rounded:.0f}" if abs(rounded) >= 10 else f"{rounded:.{1 - math.floor(math.log10(abs(rounded)))}f}"


def percent(fraction: float, decimals: int | None = None) -> str:
    """``fraction`` as a signed percentage, negative with :data:`MINUS`: "+0.2 %", "0.0 %", "+35 %";
    ``decimals`` (default: none from 1 % on, one below)."""
    value = fraction * 100
    text = f"{abs(value):.{decimals if decimals is not None else (0 if abs(value) >= 1 else 1)}f}"
    return f"{(MINUS if value < 0 else '+') if text.strip('0.') else ''}{text} %"


def mib(n: float) -> str:
    """Bytes as MiB with one decimal: "1,626.2"."""
    return f"{n / MIB:,.1f}"


def _cell(v: float | None, spec: str, scale: float = 1.0) -> str | None:
    return None if v is None else format(v * scale, spec)


def ran_as_note(r: BenchRow) -> str:
    """What a row's variant ran as on the eager engine, and why (empty when it ran as itself)."""
    return "" if r.ran_as is None else f"ran as {r.ran_as} ({r.ran_as_reason})"


def row_line(r: BenchRow) -> str:
    """One line for the progress log (the table has everything); what was not measured is left out;
    a variant that ran as another starts with what it ran as (:func:`ran_as_note`)."""
    parts = [] if r.backend == GRAPH_TREES else [f"resident {r.resident_output_bytes / MIB:,.2f} MiB"]
    parts += [f"{what} {mib(n)} MiB" for what, n in (("graph", r.graph_memory_bytes), ("forecast", r.forecast_bytes),
                                                      ("bridges", r.bridge_bytes or None)) if n is not None]
    parts += [f"capture {r.capture_s:.2f} s", f"replay {r.replay_ms:.3f} ms"]
    parts += [] if r.max_abs_err is None else [f"max abs err {r.max_abs_err:.3g}"]
    return ("" if r.ran_as is None else f"{ran_as_note(r)}: ") + ", ".join([*parts, f"fallbacks {r.fallbacks}"])


def ratios(rows: list[BenchRow], *, timings_meaningful: bool = True) -> dict[str, dict[str, float | None]]:
    """Per backend: sharing-on / sharing-off ratios (the timing ones ``None`` unless meaningful), for bench.json."""
    offs = {r.backend: r for r in rows if r.variant == "off"}
    return {r.backend: {key: getattr(r, f) / getattr(offs[r.backend], f) if getattr(r, f) is not None
                        and getattr(offs[r.backend], f) and (timings_meaningful or key not in TIMING_RATIOS) else None
                        for key, f in RATIO_FIELDS.items()} for r in rows if r.variant == "on" and r.backend in offs}


class Saving(NamedTuple):
    """One row against its backend's ``off`` row: the bytes of ``metric`` (:data:`GRAPH` where both rows measured it,
    else :data:`RESIDENT`) each holds, and the replay time's change (``None`` unless timings are meaningful)."""

    backend: str
    variant: str
    metric: str
    off_bytes: int
    held_bytes: int
    replay_change: float | None

    @property
    def saved_bytes(self) -> int:
        return self.off_bytes - self.held_bytes

    @property
    def change(self) -> float | None:
        """(held - off) / off; ``None`` where ``off`` holds nothing."""
        return (self.held_bytes - self.off_bytes) / self.off_bytes if self.off_bytes else None

    def line(self) -> str:
        """"breakable: on saves 1.0 MiB (-89 %) of resident output against off" (the minus: :data:`MINUS`)."""
        what = "graph memory" if self.metric == GRAPH else "resident output"
        change = "" if self.change is None else f" ({percent(self.change)})"
        text = (f"saves {mib(self.saved_bytes)} MiB{change} of {what} against off" if self.saved_bytes > 0
                else f"costs {mib(-self.saved_bytes)} MiB{change} more {what} than off" if self.saved_bytes < 0
                else f"holds as much {what} as off ({mib(self.held_bytes)} MiB)")
        replay = "" if self.replay_change is None else f"; replay {percent(self.replay_change, 1)}"
        return f"{self.backend}: {self.variant} {text}{replay}"

    def to_dict(self) -> dict[str, Any]:
        return {**self._asdict(), "against": "off", "saved_bytes": self.saved_bytes, "change": self.change}


def savings(rows: list[BenchRow], *, timings_meaningful: bool = True) -> list[Saving]:
    """Every row of a backend that has an ``off`` row, against it, in row order."""
    offs = {r.backend: r for r in rows if r.variant == "off"}
    out = []
    for r, off in ((r, offs[r.backend]) for r in rows if r.backend in offs and r is not offs[r.backend]):
        metric = GRAPH if r.graph_memory_bytes is not None and off.graph_memory_bytes is not None else RESIDENT
        replay = (r.replay_ms - off.replay_ms) / off.replay_ms if timings_meaningful and off.replay_ms else None
        out.append(Saving(r.backend, r.variant, metric, getattr(off, metric), getattr(r, metric), replay))
    return out


class Column(NamedTuple):
    """A table column: its two header lines (name, unit) and its cell per row (``None``: does not
    apply to the row: ``-``; a column that applies to no row is left out)."""

    head: tuple[str, str]
    cell: Callable[[BenchRow], str | None]
    left: bool = False


COLUMNS: dict[str, Column] = {
    "backend": Column(("backend", ""), lambda r: r.backend, left=True),
    "variant": Column(("variant", ""), lambda r: r.variant + (STAR if r.ran_as is not None else ""), left=True),
    "graph": Column(("graph", "MiB"), lambda r: _cell(r.graph_memory_bytes, ",.1f", 1 / MIB)),
    "forecast": Column(("forecast", "MiB"), lambda r: _cell(r.forecast_bytes, ",.1f", 1 / MIB)),
    "error": Column(("error", "%"), lambda r: _cell(r.forecast_error, "+.1f", 100)),
    "resident": Column(("resident", "MiB"), lambda r: "n/a" if r.backend == GRAPH_TREES
                       else _cell(r.resident_output_bytes, ",.1f", 1 / MIB)),
    "logical": Column(("logical", "MiB"), lambda r: _cell(r.logical_output_bytes, ",.1f", 1 / MIB)),
    "bridges": Column(("bridges", "MiB"), lambda r: _cell(r.bridge_bytes or None, ",.1f", 1 / MIB)),
    "capture": Column(("capture", "s"), lambda r: f"{r.capture_s:.2f}"),
    "compile": Column(("compile", "s"), lambda r: _cell(r.compile_s, ".2f")),
    "replay": Column(("replay", "ms"), lambda r: f"{r.replay_ms:.3f}"),
    "max_abs_err": Column(("max abs", "err"), lambda r: _cell(r.max_abs_err, ".3g")),
    "fallbacks": Column(("fall-", "backs"), lambda r: str(r.fallbacks)),
}
#: Left out, in this order, where the table would be wider than its width (bench.json has them).
DROP_ORDER = ("logical", "bridges", "compile", "capture", "max_abs_err", "error", "forecast")
#: Where the table is too wide, names are cut (with "…") to this first (the longest variant's), and
#: to ``MIN_NAME_WIDTH`` at most where leaving columns out was not enough (a variant's :data:`STAR` counts).
NAME_WIDTH, MIN_NAME_WIDTH = max(map(len, VARIANTS)) + len(STAR), 8


def _widths(cells: dict[str, list[str]]) -> dict[str, int]:
    return {k: max(len(c) for c in (*COLUMNS[k].head, *col)) for k, col in cells.items()}


def _fit(rows: list[BenchRow], width: int) -> tuple[dict[str, list[str]], list[str]]:
    """The table's cells by column (a column no row has left out), made to fit ``width``: names cut to ``NAME_WIDTH``,
    then ``DROP_ORDER``'s columns left out, then the names cut further (the backend's first); and the keys left out."""
    cells = {k: ["-" if c is None else c for c in col] for k, col in
             ((k, [c.cell(r) for r in rows]) for k, c in COLUMNS.items())
             if k in ("backend", "variant") or any(c is not None for c in col)}

    def excess() -> int:
        return sum(_widths(cells).values()) + 2 * (len(cells) - 1) - width

    def cut(key: str, keep: int) -> None:  # to ``keep`` characters, with "…" (a variant's STAR kept)
        stars = [STAR if key == "variant" and c.endswith(STAR) else "" for c in cells[key]]
        cells[key] = [c if len(c) <= keep else f"{c[:keep - 1 - len(s)]}{ELLIPSIS}{s}"
                      for c, s in zip(cells[key], stars, strict=True)]

    if excess() > 0:
        for key in ("backend", "variant"):
            cut(key, NAME_WIDTH)
    dropped = []
    for key in DROP_ORDER:
        if key in cells and excess() > 0:
            del cells[key]
            dropped.append(key)
    for key in ("backend", "variant"):
        if (over := excess()) > 0:
            cut(key, max(MIN_NAME_WIDTH, _widths(cells)[key] - over))
    return cells, dropped


def format_table(rows: list[BenchRow], *, timings_meaningful: bool = True, width: int = TABLE_WIDTH) -> str:
    """The rows as a table at most ``width`` columns wide (a column no row has is left out; where it is still too
    wide, ``DROP_ORDER``'s, said in a line), then a footnote per starred variant (one that ran as another:
    ``packed*: ran as on (...)``), then Graph Trees' note, then what each row saves against its backend's ``off``
    (MiB and %), each wrapped to ``width``, then, where timings are not meaningful (CPU), :data:`CPU_NOTE`."""
    shown, dropped = _fit(rows, width)
    widths = _widths(shown)

    def line(texts: list[str]) -> str:
        return "  ".join(t.ljust(widths[k]) if COLUMNS[k].left else t.rjust(widths[k])
                         for k, t in zip(shown, texts, strict=True)).rstrip()

    lines = [*(line([COLUMNS[k].head[i] for k in shown]) for i in (0, 1)), "  ".join("-" * w for w in widths.values())]
    lines += [line([shown[k][i] for k in shown]) for i in range(len(rows))]
    notes = [f"{variant}{STAR}: {note}" for variant, note in {r.variant: ran_as_note(r) for r in rows
                                                                if r.ran_as is not None}.items()]
    if dropped:
        names = ", ".join(" ".join(COLUMNS[k].head).strip() for k in dropped)
        notes.append(f"left out to fit {width} columns (bench.json has them): {names}")
    notes += [GRAPH_TREES_NOTE] if any(r.backend == GRAPH_TREES for r in rows) else []
    notes += [s.line() for s in savings(rows, timings_meaningful=timings_meaningful)]
    lines += [part for note in notes for part in textwrap.wrap(note, width, subsequent_indent="  ")]
    return "\n".join(lines if timings_meaningful else [*lines, CPU_NOTE])


def printable(text: str, encoding: str | None) -> str:
    """``text`` as a stream of ``encoding`` can print it: where it cannot print the minus sign or
    "…" (Latin-1, cp1252), "-" and "...", any other such character replaced."""
    try:
        text.encode(codec := encoding or "utf-8")
    except UnicodeEncodeError:
        return text.replace(MINUS, "-").replace(ELLIPSIS, "...").encode(codec, errors="replace").decode(codec)
    except LookupError:
        pass
    return text


def write_json(path: Path, device: str, config: dict[str, Any], rows: list[BenchRow], *,
               timings_meaningful: bool = True, cold: dict[str, Any] | None = None) -> None:
    """``bench.json``: versions, UTC timestamp, config, rows (with per-size rows), ratios, the savings
    the table prints (:func:`savings`), and ``cold`` (:func:`~.runner.cold_summary`)."""
    path.write_text(json.dumps({
        "package_version": __version__, "torch_version": torch.__version__,
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "device": device,
        "timings_meaningful": timings_meaningful, "config": config, "rows": [r.to_dict() for r in rows],
        "ratios": ratios(rows, timings_meaningful=timings_meaningful),
        "savings": [s.to_dict() for s in savings(rows, timings_meaningful=timings_meaningful)], "cold": cold,
    }, indent=2) + "\n")


#: The metrics of every bar of ``bench.png``, one panel each, in panel order.
PLOT_METRICS = ("memory_mib", "replay_ms")
#: The reference row's color (each variant's: ``VARIANTS``).
REFERENCE_COLOR = "#4bacc6"
#: Graph Trees' legend label: torch's own CUDA graphs (on CPU the same compile, without graphs).
GRAPH_TREES_LABEL = "torch's CUDA Graph Trees (torch.compile reduce-overhead)"
GRAPH_TREES_CPU_LABEL = "torch.compile without mode (CPU stand-in: Graph Trees need CUDA)"
FORECAST_LABEL = "forecast before capture (CaptureBackend.forecast)"
#: Caption under the plot when Graph Trees' resident-output bar is left out (CPU).
NO_RESIDENT_CAPTION = ("graph-trees: no memory bar: resident output does not apply (Graph Trees keep no output past "
                       "the next step)")
#: Caption of the CPU plot, which leaves replay timing out: eager CPU time is not CUDA-graph replay
#: (on a noisy machine its bars would read as one mode costing a multiple of another).
CPU_CAPTION = ("CPU, eager engine: replay timing left out (eager CPU time is not CUDA-graph replay; bench.json "
               "keeps it).\n'released' keeps outputs here as 'off' does (no graph pool). Graph memory and replay on "
               "CUDA graphs: docs/benchmarks.md")


class PlotBar(NamedTuple):
    """One bar per panel: a row's ``values`` (``PLOT_METRICS`` keys; ``None``: the metric does not apply, no bar is
    drawn), its replay spread (below, above the median) and the forecast made before capture (graph memory only)."""

    variant: str
    label: str
    values: dict[str, float | None]
    replay_spread: tuple[float, float]
    forecast_mib: float | None = None


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
    return [PlotGroup(b, "graph-trees\n(torch's CUDA\nGraph Trees)" if b == GRAPH_TREES else b, b == GRAPH_TREES,
                      [_bar(r, graph_memory) for r in rows if r.backend == b]) for b in backends]


def _draw(axes: dict[str, Any], groups: list[PlotGroup]) -> bool:
    """Draw every group's bars on ``axes`` (one per drawn ``PLOT_METRICS`` key); ``True``: one left out."""
    width = 0.8 / max((len(g.bars) for g in groups), default=1)
    left_out = False
    for j, group in enumerate(groups):
        for i, bar in enumerate(group.bars):
            x = j + (i - (len(group.bars) - 1) / 2) * width
            style = {"color": REFERENCE_COLOR if group.reference else VARIANTS[bar.variant].color,
                     "hatch": "//" if group.reference else None, "edgecolor": "white" if group.reference else None,
                     "label": bar.label}  # one legend entry per label: write_plot's
            for metric, ax in axes.items():
                if (value := bar.values[metric]) is None:  # no bar, but its legend entry (from the first panel)
                    ax.bar([x], [0.0], width, **style)
                    ax.annotate("n/a\n(see below)", (x, 0), ha="center", va="bottom", fontsize=8, color="#555555")
                    left_out = True
                    continue
                yerr = [[bar.replay_spread[0]], [bar.replay_spread[1]]] if metric == "replay_ms" else None
                drawn = ax.bar([x], [value], width, yerr=yerr, capsize=3, **style)
                if metric == "memory_mib":  # upright labels overlap once a group has five bars
                    ax.bar_label(drawn, labels=[sig2(value)], fontsize=8, rotation=90 if width < 0.18 else 0)
                    if bar.forecast_mib is not None:  # the forecast made before the capture
                        ax.plot([x - width / 2, x + width / 2], [bar.forecast_mib] * 2, color="black", linewidth=1.5,
                                label=FORECAST_LABEL)
    return left_out


def write_plot(path: Path, device: str, config: dict[str, Any], rows: list[BenchRow], *,
               timings_meaningful: bool = True) -> bool:
    """Write ``bench.png``: memory and replay panels; without meaningful timings (CPU) the memory
    panel alone and :data:`CPU_CAPTION`. ``False`` when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    use_graph = all(r.graph_memory_bytes is not None for r in rows)
    groups = plot_groups(rows, graph_memory=use_graph)
    metrics = PLOT_METRICS if timings_meaningful else PLOT_METRICS[:1]
    fig, panels = plt.subplots(1, len(metrics), figsize=(6 * len(metrics) + (0 if timings_meaningful else 2), 5.2),
                               squeeze=False)
    axes = dict(zip(metrics, panels[0], strict=True))
    left_out = _draw(axes, groups)
    titles = {"memory_mib": ("graph pool memory (MiB)", "Memory held by captured graphs") if use_graph
              else ("resident output memory (MiB)", "Output memory held (eager engine, CPU)"),
              "replay_ms": (f"replay at {config.get('max_tokens')} tokens (ms, median)",
                            "Replay time at the largest size")}
    for metric, ax in axes.items():  # Graph Trees' group set apart
        ax.set(ylabel=titles[metric][0], title=titles[metric][1])
        ax.set_xticks(range(len(groups)), [g.tick for g in groups])
        ax.set_xlim(-0.5, len(groups) - 0.5)  # a group without a bar keeps its place
        if groups and groups[-1].reference and len(groups) > 1:
            ax.axvline(len(groups) - 1.5, color="#888888", linestyle="--", linewidth=0.8)
    ax_mem = axes["memory_mib"]
    top = max((b.get_height() for b in ax_mem.patches), default=0.0)
    ax_mem.set_ylim(0, top * 1.15 if top > 0 else 1.0)
    # every bar has a memory bar or stand-in, so the memory panel holds every legend entry; the forecast's last
    handles, labels = ax_mem.get_legend_handles_labels()
    legend = dict(sorted(zip(labels, handles, strict=True), key=lambda lh: lh[0] == FORECAST_LABEL))  # one per label
    captions = [*([] if timings_meaningful else CPU_CAPTION.splitlines()), *([NO_RESIDENT_CAPTION] if left_out else [])]
    ncol = min(len(legend), 3) or 1
    below = 0.03 * len(captions) + (0.01 if captions else 0.0)
    fig.legend(list(legend.values()), list(legend), loc="lower center", ncol=ncol, fontsize=8,
               bbox_to_anchor=(0.5, below), frameon=False)
    fig.suptitle(f"sglang-bcg bench on {device}: {config.get('layers')} layers, hidden {config.get('hidden')}, "
                 f"{config.get('dtype')}, {config.get('num_sizes')} sizes up to {config.get('max_tokens')} tokens",
                 fontsize=10)
    for k, caption in enumerate(captions):
        fig.text(0.5, 0.01 + 0.03 * (len(captions) - 1 - k), caption, ha="center", va="bottom", fontsize=8,
                 style="italic")
    fig.tight_layout(rect=(0, below + 0.045 * -(-len(legend) // ncol), 1, 1))
    fig.savefig(path, dpi=120, format="png")  # path may be a temporary name
    plt.close(fig)
    return True
