"""``MemoryReport``: what a backend's captured outputs cost."""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

from .trees import flatten, storage_key


@dataclass(frozen=True, slots=True)
class KeyReport:
    """Accounting for one captured shape key: ``resident_output_bytes`` no earlier key holds, the ``fallback`` reason
    (else ``None``), warmups plus capture seconds, reserved device memory growth (``None`` on the eager engine)."""

    key: Hashable
    logical_output_bytes: int
    resident_output_bytes: int
    shared: bool
    fallback: str | None
    capture_seconds: float | None
    graph_memory_bytes: int | None
    num_segments: int


@dataclass(frozen=True, slots=True)
class MemoryReport:
    """Output memory of every captured key of one backend."""

    backend: str
    engine: str
    keys: tuple[KeyReport, ...] = ()
    logical_output_bytes: int = 0
    resident_output_bytes: int = 0
    fallbacks: Mapping[Hashable, str] = field(default_factory=lambda: MappingProxyType({}))
    capture_seconds: Mapping[Hashable, float] = field(default_factory=lambda: MappingProxyType({}))
    #: Bytes of bridge storage per partition (empty for our backends: values cross as they are).
    bridge_bytes: Mapping[int | None, int] = field(default_factory=lambda: MappingProxyType({}))
    #: The forecast made before the capture (``CaptureBackend.forecast``), else ``None``.
    forecast: Any = None
    #: The latest session's ``output.plan.SessionPlan``, else ``None``.
    plan: Any = None
    #: Device memory the session took, measured only after a forecast, else ``None``.
    measured_graph_bytes: int | None = None

    @property
    def lost_bytes(self) -> int | None:
        """:attr:`measured_graph_bytes` plus what the forecast (its eager forwards and probes) left
        lost; ``None`` without both."""
        if self.forecast is None or self.measured_graph_bytes is None:
            return None
        return self.measured_graph_bytes + int(getattr(self.forecast, "lasting_bytes", 0) or 0)

    @property
    def forecast_error(self) -> float | None:
        """(forecast − lost) / lost for the session's mode; ``None`` without both."""
        lost = self.lost_bytes
        return None if self.forecast is None or not lost else (self.forecast.bytes_for() - lost) / lost

    @property
    def allocator_error(self) -> float | None:
        """(forecast without the driver's share − measured) / measured; ``None`` without both."""
        if self.forecast is None or not self.measured_graph_bytes:
            return None
        return (self.forecast.bytes_for(driver=False) - self.measured_graph_bytes) / self.measured_graph_bytes

    @property
    def saved_bytes(self) -> int:
        """``logical_output_bytes - resident_output_bytes``."""
        return self.logical_output_bytes - self.resident_output_bytes

    @property
    def total_bridge_bytes(self) -> int:
        """Bridge bytes summed over partitions."""
        return sum(self.bridge_bytes.values())

    @classmethod
    def from_keys(cls, backend: str, engine: str, keys: list[KeyReport],
                  bridge_bytes: Mapping[int | None, int] | None = None) -> MemoryReport:
        seconds = {k.key: k.capture_seconds for k in keys if k.capture_seconds is not None}
        return cls(backend, engine, tuple(keys), logical_output_bytes=sum(k.logical_output_bytes for k in keys),
                   resident_output_bytes=sum(k.resident_output_bytes for k in keys),
                   fallbacks=MappingProxyType({k.key: k.fallback for k in keys if k.fallback is not None}),
                   capture_seconds=MappingProxyType(seconds), bridge_bytes=MappingProxyType(dict(bridge_bytes or {})))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (keys rendered with ``repr``)."""
        return {
            "backend": self.backend,
            "engine": self.engine,
            "logical_output_bytes": self.logical_output_bytes,
            "resident_output_bytes": self.resident_output_bytes,
            "saved_bytes": self.saved_bytes,
            "fallbacks": {repr(k): v for k, v in self.fallbacks.items()},
            "bridge_bytes": {str(p): b for p, b in self.bridge_bytes.items()},
            "plan": None if self.plan is None else self.plan.to_dict(),
            "forecast": None if self.forecast is None else self.forecast.to_dict(),
            "measured_graph_bytes": self.measured_graph_bytes,
            "lost_bytes": self.lost_bytes,
            "forecast_error": self.forecast_error,
            "allocator_error": self.allocator_error,
            "keys": [{**{f.name: getattr(k, f.name) for f in fields(KeyReport)}, "key": repr(k.key)}
                     for k in self.keys],
        }

    def format(self) -> str:
        """A short human-readable summary."""
        mib = 1024 * 1024
        n = len(self.keys)
        lines = [
            f"{self.backend} backend ({self.engine} engine): {n} {'key' if n == 1 else 'keys'}, "
            f"logical {self.logical_output_bytes / mib:.2f} MiB, "
            f"resident {self.resident_output_bytes / mib:.2f} MiB, "
            f"saved {self.saved_bytes / mib:.2f} MiB"
        ]
        lines.extend(f"  bridges of partition {p}: {b / mib:.2f} MiB" for p, b in self.bridge_bytes.items() if b)
        lines.extend(f"  fallback {k!r}: {why}" for k, why in self.fallbacks.items())
        if self.plan is not None:
            lines.append(f"  session: {self.plan.format()}")
        if self.forecast is not None:
            lines.append(self._forecast_line(mib))
        return "\n".join(lines)

    def _forecast_line(self, mib: int) -> str:
        forecast, lost = self.forecast, self.lost_bytes
        total, allocator = forecast.bytes_for(), forecast.bytes_for(driver=False)
        err = "" if self.forecast_error is None else f", error {self.forecast_error * 100:+.1f} %"
        if total == allocator and lost == self.measured_graph_bytes:
            measured = "not measured" if lost is None else f"measured {lost / mib:.1f} MiB"
        else:
            measured = "not measured" if lost is None else f"lost {lost / mib:.1f} MiB since before the forecast"
            left = int(getattr(forecast.modes[forecast.mode], "probe_left_bytes", 0) or 0)
            probes = f" and the probes' capture stream {left / mib:.1f} MiB" if left else ""
            err += (f"; the CUDA driver's share {(total - allocator - left) / mib:.1f} MiB{probes} of it; "
                    f"without {'them' if left else 'it'} {allocator / mib:.1f} MiB")
            if self.allocator_error is not None and self.measured_graph_bytes is not None:
                err += (f" against the session's own drop {self.measured_graph_bytes / mib:.1f} MiB, "
                        f"error {self.allocator_error * 100:+.1f} %")
        return f"  graph memory: forecast {total / mib:.1f} MiB ({forecast.mode}), {measured}{err}"


def claim_resident_bytes(output: object, seen: set[tuple[str, int]]) -> int:
    """Bytes of the storages behind ``output``'s tensor leaves not already in ``seen`` (added to it)."""
    total = 0
    for _, t in flatten(output)[1]:
        sk = storage_key(t)
        if sk not in seen:
            seen.add(sk)
            total += t.untyped_storage().nbytes()
    return total
