"""Merge ``forecast_driver_check.py`` rows into ``tests/data/forecast/h200_fresh_processes.json.gz``
and print the docs/forecast.md table from the result (CPU only; not a test).

``python3 tests/gpu/merge_fresh_rows.py [--command TEXT] [DIR/forecast_driver.json ...]``: each new
row replaces the recorded one of the same model, backend, mode, schedule and pool reserve (a row
without ``schedule`` is SGLang's prefill list, without ``pool_reserve`` ``off``); ``--command``
records how they were measured. With no file, it only prints the table: "forecast vs lost" per
model x backend x mode, the forecast rebuilt from the probes with today's model (as
``tests/test_forecast_fresh.py`` does), ¹ on rows recorded before the forecast ran its first
launches.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "forecast" / "h200_fresh_processes.json.gz"
KEEP = ("model", "backend", "mode", "schedule", "pool_reserve", "num_sizes", "max_tokens", "lost_bytes",
        "session_drop_bytes", "lasting_bytes", "probe_driver_bytes", "forecast_bytes", "allocator_bytes",
        "driver_bytes", "pool_bytes", "stream_bytes", "driver", "forecast", "probes", "caveat",
        "probe_phase_lost_bytes", "session_lost_bytes", "probe_phase_reserved_bytes", "session_reserved_bytes",
        "kept_segments")


def row_key(row: dict[str, Any]) -> tuple[str, ...]:
    return (row["model"], row["backend"], row["mode"], row.get("schedule", "prefill"), row.get("pool_reserve", "off"))


def merge(data: dict[str, Any], files: list[Path], command: str) -> int:
    """Replace or add the files' rows in ``data``; returns how many."""
    rows = {row_key(r): r for r in data["rows"]}
    added = 0
    for path in files:
        for r in json.loads(path.read_text())["rows"]:
            rows[row_key(r)] = {k: r[k] for k in KEEP if k in r}
            added += 1
    order = {"synthetic": 0, "qwen2": 1, "gemma": 2, "gpt_neox": 3, "phi3": 4}
    data["rows"] = sorted(rows.values(), key=lambda r: (order.get(r["model"], 9), *row_key(r)))
    if command:
        data["commands"].append(command)
    return added


def table(rows: list[dict[str, Any]]) -> str:
    sys.path.insert(0, str(ROOT / "tests"))
    from test_forecast_fresh import _rebuilt, swept  # the test's own rebuild

    cells: dict[tuple[str, ...], str] = {}
    for r in rows:
        forecast, lost = _rebuilt(r), r["lost_bytes"]
        mark = "" if swept(r) else "¹"
        error = f"{(forecast - lost) / lost * 100:+.1f}".replace("-", "−")
        cells[row_key(r)] = f"{forecast / 2**20:.1f} vs {lost / 2**20:.0f} ({error} %){mark}"
    lines = ["| model | Full off / on / released | Breakable off / on / released | Piecewise off / on / released |",
             "|---|---|---|---|"]
    for model, schedule, reserve in sorted({(k[0], k[3], k[4]) for k in cells}):
        name = model + ("" if schedule == "prefill" else f", {schedule}") + ("" if reserve == "off" else f", pool_reserve {reserve}")
        groups = [" / ".join(cells.get((model, b, m, schedule, reserve), "–") for m in ("off", "on", "released"))
                  for b in ("full", "breakable", "piecewise")]
        lines.append(f"| {name} | " + " | ".join(groups) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", type=Path)
    ap.add_argument("--command", default="", help="how the new rows were measured (recorded in the data)")
    args = ap.parse_args(argv)
    data = json.loads(gzip.decompress(DATA.read_bytes()))
    if args.files:
        print(f"{merge(data, args.files, args.command)} rows merged; {len(data['rows'])} in all", file=sys.stderr)
        DATA.write_bytes(gzip.compress(json.dumps(data).encode(), mtime=0))
    print(table(data["rows"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
