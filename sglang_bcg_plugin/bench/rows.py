"""One bench row per backend x variant, with its per-size rows: what the table, ``bench.json``
and ``bench.png`` show."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from ..report import MemoryReport


@dataclass
class BenchRow:
    backend: str
    variant: str
    share_output: bool | Literal["released"]
    num_sizes: int
    max_tokens: int
    resident_output_bytes: int
    logical_output_bytes: int
    graph_memory_bytes: int | None
    capture_s: float
    replay_ms: float
    max_abs_err: float | None
    fallbacks: int
    bridge_bytes: int = 0
    model: str = "synthetic"
    #: fastest and slowest of the timed replays (the spread of ``replay_ms``, the median).
    replay_ms_min: float = 0.0
    replay_ms_max: float = 0.0
    #: one dict per captured key, largest first (:func:`per_size_rows`)
    per_size: list[dict[str, Any]] = field(default_factory=list)
    #: seconds of the calls that compiled, not in ``capture_s``; ``None``: nothing compiled
    compile_s: float | None = None
    #: the forecast before the capture (CUDA; docs/getting-started.md), else ``None``
    forecast_bytes: int | None = None
    forecast_error: float | None = None
    forecast_s: float | None = None
    forecast: dict[str, Any] | None = None
    forecast_driver_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        """One line for the progress log (the table has everything)."""
        graph = "-" if self.graph_memory_bytes is None else f"{self.graph_memory_bytes / 2**20:,.1f}"
        err = "-" if self.max_abs_err is None else f"{self.max_abs_err:.3g}"
        return (
            f"resident {self.resident_output_bytes / 2**20:,.2f} MiB, graph {graph} MiB, "
            f"bridges {self.bridge_bytes / 2**20:,.1f} MiB, capture {self.capture_s:.2f} s, "
            f"replay {self.replay_ms:.3f} ms, max abs err {err}, fallbacks {self.fallbacks}"
            + ("" if self.forecast_bytes is None else f", forecast {self.forecast_bytes / 2**20:,.1f} MiB")
        )


def per_size_rows(report: MemoryReport, compile_s: dict[Any, float] | None = None) -> list[dict[str, Any]]:
    """``bench.json``'s per-size rows from ``memory_report().keys``; ``compile_s`` per key is taken
    out of its ``capture_s``."""
    spent = compile_s or {}
    return [
        {
            "size": getattr(k.key, "size", None),
            "stream_idx": getattr(k.key, "stream_idx", None),
            "logical_output_bytes": k.logical_output_bytes,
            "resident_output_bytes": k.resident_output_bytes,
            "shared": k.shared,
            "fallback": k.fallback,
            "capture_s": None if k.capture_seconds is None else k.capture_seconds - spent.get(k.key, 0.0),
            "compile_s": spent.get(k.key) if compile_s is not None else None,
            "graph_memory_bytes": k.graph_memory_bytes,
            "num_segments": k.num_segments,
        }
        for k in report.keys
    ]
