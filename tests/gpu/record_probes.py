"""Record the forecast's probe captures while the bench runs, in the format of
``tests/data/forecast/h200_probes.json.gz`` (issue 21: tune the pool-block search offline).

``python3 tests/gpu/record_probes.py OUT.json.gz -- BENCH-ARGS`` runs ``sglang-bcg bench
BENCH-ARGS`` in this process (for example ``--model llama --variants inductor-released
--backends piecewise``) and, for every row the bench forecast, writes one case named
``MODEL/BACKEND/VARIANT``:

* ``sizes``: the schedule, largest first; ``largest_output_bytes``: the largest probe's output;
* ``pool_segments``: ``[address, bytes]`` of the probes' pool; ``probes``: per probe size, the
  allocator events ``[action, address, size]`` the forecast read (``tests/test_forecast.py``
  replays them through ``pool_trace``);
* ``measured``: the row's ``graph_bytes`` (``mem_get_info`` delta of the capture), its forecast
  and the mode, keyed by the variant.

A measurement aid, not a test. Needs CUDA (the bench forecasts on the CUDA engine only).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from sglang_bcg_plugin.bench.sizes import prefill_capture_sizes
from sglang_bcg_plugin.cli import main as cli_main
from sglang_bcg_plugin.forecast import probe

USAGE = "usage: python3 tests/gpu/record_probes.py OUT.json.gz -- BENCH-ARGS"


@contextlib.contextmanager
def recording() -> Iterator[list[dict[str, Any]]]:
    """While open, every forecast appends what its probes read: the schedule, the events of each
    probe, the pool's segments and the largest probe's output bytes."""
    forecasts: list[dict[str, Any]] = []
    schedule, trace, probe_run = probe.forecast_schedule, probe.pool_trace, probe._probe

    def forecast_schedule(backend: Any, sizes: Any, *args: Any, **kwargs: Any) -> Any:
        sizes = list(sizes)
        forecasts.append({"sizes": sorted(set(sizes), reverse=True), "probes": {}, "pool_segments": []})
        return schedule(backend, sizes, *args, **kwargs)

    def pool_trace(size: int, events: Any, segments: Any) -> Any:
        events = list(events)
        current = forecasts[-1]
        current["probes"][str(size)] = [[e["action"], int(e["addr"]), int(e["size"])] for e in events]
        current["pool_segments"] = [[int(a), int(n)] for a, n in segments]
        return trace(size, events, segments)

    def probe_sizes(*args: Any, **kwargs: Any) -> Any:
        result = probe_run(*args, **kwargs)
        forecasts[-1]["largest_output_bytes"] = int(sum(result[1][0]))
        forecasts[-1]["output_bytes"] = [[int(b) for b in out] for out in result[1]]  # per probe, in order
        return result

    probe.forecast_schedule, probe.pool_trace, probe._probe = forecast_schedule, pool_trace, probe_sizes
    try:
        yield forecasts
    finally:
        probe.forecast_schedule, probe.pool_trace, probe._probe = schedule, trace, probe_run


def record(bench_args: list[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run the bench with the forecast's probes recorded; its ``bench.json`` and the probes of
    each forecast, in order."""
    with tempfile.TemporaryDirectory() as out, recording() as forecasts:
        status = cli_main(["bench", *bench_args, "--no-progress", "--out", out])
        if status:
            msg = f"the bench exited with {status}"
            raise SystemExit(msg)
        bench = json.loads((Path(out) / "bench.json").read_text())
    return bench, forecasts


def cases(bench: dict[str, Any], forecasts: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """One case per forecast row, matched in order (rows without a forecast had none)."""
    rows = [r for r in bench["rows"] if r.get("forecast")]
    if len(rows) != len(forecasts):
        msg = f"{len(rows)} rows carry a forecast but {len(forecasts)} forecasts ran"
        raise SystemExit(msg)
    expected = sorted(prefill_capture_sizes(bench["config"]["max_tokens"]), reverse=True)
    out: dict[str, dict[str, Any]] = {}
    for row, fc in zip(rows, forecasts, strict=True):
        if fc["sizes"] != expected[: len(fc["sizes"])] or len(fc["probes"]) != 2:
            msg = f"{row['backend']}/{row['variant']}: unexpected schedule or probes {sorted(fc['probes'])}"
            raise SystemExit(msg)
        out[f"{row['model']}/{row['backend']}/{row['variant']}"] = {
            **fc,
            "measured": {row["variant"]: {"graph_bytes": row["graph_memory_bytes"], "forecast_bytes": row["forecast_bytes"],
                                          "mode": row["forecast"]["mode"], "forecast": row["forecast"]}},
        }
    return out


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[1] != "--":
        print(USAGE, file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("record_probes.py needs CUDA: the bench forecasts on the CUDA engine only", file=sys.stderr)
        return 2
    bench, forecasts = record(argv[2:])
    data = {"machine": f"{torch.cuda.get_device_name()}, torch {torch.__version__}; tests/gpu/record_probes.py",
            "cases": cases(bench, forecasts)}
    with gzip.open(argv[0], "wt") as f:
        json.dump(data, f)
    print(f"wrote {len(data['cases'])} cases to {argv[0]}: {', '.join(data['cases'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
