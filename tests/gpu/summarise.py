"""Print the figures of ``sglang_engine.json`` (written by ``sglang_gpu_driver.run_variants``).

Usage: ``python tests/gpu/summarise.py DIR_OR_FILE [RESULT_LINE_FILE...]``; the extra files hold a
driver's ``RESULT=`` line (one variant run by hand). One line per variant: graph MiB, replay ms,
max abs error, resident output MiB, error; for ``recapture`` the one-time steps and each cycle's
free-memory drift (KiB).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

MIB = 1 << 20


def line(name: str, entry: dict[str, Any]) -> str:
    r = entry.get("result", entry)
    if isinstance(r, list):
        return f"{name}: " + "; ".join(f"{x.get('backend')}/{x.get('variant')} {x.get('graph_memory_bytes', 0) / MIB:.0f} MiB" for x in r)
    if name.startswith("recapture") or r.get("variant") == "recapture":
        one = r.get("one_time", {})
        start = one.get("before_any_graph_free_bytes", 0)
        steps = {k: (start - v) // 1024 for k, v in one.items() if k.endswith("_free") and isinstance(v, int)}
        drift = [(c["cycle"], c["mode"], c["drift_free_bytes"] // 1024, c["drift_reserved_bytes"]) for c in r.get("cycles", [])]
        return f"{name}: one-time KiB below start {steps}; cycles (n, mode, free drift KiB, reserved drift B) {drift}"
    keys = {"graph_mib": r.get("graph_bytes", 0) / MIB if r.get("graph_bytes") is not None else None,
            "replay_ms": r.get("replay_ms"), "max_abs_err": r.get("max_abs_err"),
            "resident_mib": (r["resident_output_bytes"] / MIB) if r.get("resident_output_bytes") is not None else None,
            "mode": r.get("mode"), "error": r.get("error") or entry.get("error"), "second_capture": r.get("second_capture"),
            "first_capture_drift_free_kib": (r["first_capture_drift_free_bytes"] // 1024) if "first_capture_drift_free_bytes" in r else None}
    meta = entry.get("meta", {})
    return f"{name}: " + json.dumps({k: v for k, v in keys.items() if v is not None}) + f" setup {meta.get('setup_s')} s"


def main(argv: list[str]) -> int:
    path = Path(argv[0])
    data = json.loads((path / "sglang_engine.json" if path.is_dir() else path).read_text())
    for name, entry in data.items():
        print(line(name, entry))
    for extra in argv[1:]:
        for ln in Path(extra).read_text().splitlines():
            if ln.startswith("RESULT="):
                print(line(extra, json.loads(ln[len("RESULT="):])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
