"""``plan_session``: everything a capture session fixes, decided once, with why; the only place a
forecast steers anything. ``memory_report().plan`` shows the latest plan."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from ..guard import guard_supported
from ..output_mode import ON, RELEASED, OutputMode, Resolution
from ..sharing import BufferSource

if TYPE_CHECKING:
    from ..forecast.probe import GraphMemoryForecast

_MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class SessionPlan:
    """What one capture session runs with; each choice a forecast may steer carries its reason."""

    resolution: Resolution
    buffer_source: BufferSource
    buffer_reason: str
    #: the stale-output guard was asked for (the option, or a host's switch) ...
    guard: bool = False
    #: ... and this torch build can poison storages, so it runs (``guard_supported()``)
    guard_armed: bool = False
    #: the engine the session captures with: ``"eager"`` has no graph pool (nothing to release or reserve)
    engine: str = "cuda"
    strict: bool = False
    check_inputs: bool = False
    #: mode ``released``: the session's first (largest) capture keeps its output
    released_keeps_largest: bool = False
    pool_reserve_bytes: int = 0
    pool_reason: str = "off"

    @property
    def mode(self) -> OutputMode:
        return self.resolution.mode

    @property
    def releases_outputs(self) -> bool:
        """Mode ``released`` on an engine with a graph pool: outputs become non-owning aliases of it
        (the eager engine has none: its outputs stay owned, as with ``off``)."""
        return self.mode == RELEASED and self.engine != "eager"

    def to_dict(self) -> dict[str, object]:
        rest = {f.name: getattr(self, f.name) for f in fields(self)[1:]}  # after the resolution
        return {"mode": self.mode, "mode_reason": self.resolution.source, **rest,
                "releases_outputs": self.releases_outputs}

    def format(self) -> str:
        """One line: the mode and why, then what else the session fixed, as it runs on its engine."""
        parts = [f"mode {self.resolution.describe()}"]
        if self.engine != "eager":
            parts.append(f"{self.buffer_source} buffer ({self.buffer_reason})")
            if self.mode == RELEASED:
                kept = "keeps" if self.released_keeps_largest else "releases"
                parts.append(f"the largest capture {kept} its output")
        elif self.mode == ON:
            parts.append(f"{self.buffer_source} buffer ({self.buffer_reason})")
        elif self.mode == RELEASED:
            parts.append("eager engine: no graph pool to release outputs into, so nothing is released and every "
                         "key keeps its own output, as with off")
        if self.pool_reserve_bytes:
            parts.append(f"pool starts with a {self.pool_reserve_bytes / _MIB:.1f} MiB block ({self.pool_reason})")
        if self.guard and not self.guard_armed:
            parts.append("guard asked for but not armed: this torch build cannot poison storages (a CUDA build "
                         "can), so replays hand out outputs unguarded")
        parts += [name for name, on in (("guard", self.guard_armed), ("strict", self.strict),
                                        ("input check", self.check_inputs)) if on]
        return "; ".join(parts)


def _buffer(choice: str, engine: str, forecast: GraphMemoryForecast | None) -> tuple[BufferSource, str]:
    if choice in ("adopt", "reserve"):
        return choice, "option"  # type: ignore[return-value]
    if engine != "cuda":
        return "adopt", f"auto: no pool to fragment on the {engine} engine"
    if forecast is None:
        return "reserve", "auto: no forecast, a reserved buffer costs one output at most"
    return forecast.buffer_source, "auto: the forecast found it cheaper"  # type: ignore[return-value]


def _pool(choice: str | int, engine: str, forecast: GraphMemoryForecast | None) -> tuple[int, str]:
    if engine != "cuda" or choice == "off":
        return 0, "off"
    if isinstance(choice, int):
        return choice, "option"
    if forecast is None or not forecast.pool_reserve_bytes:
        return 0, "auto: no forecast or no saving"
    return int(forecast.pool_reserve_bytes), "auto: the forecast's block"


def plan_session(resolution: Resolution, *, engine: str, shared_buffer: str = "auto", pool_reserve: str | int = "off",
                 guard: bool = False, strict: bool = False, check_inputs: bool = False,
                 forecast: GraphMemoryForecast | None = None, captured: bool = False) -> SessionPlan:
    """The plan of a session that resolved ``resolution`` on ``engine``, after ``forecast`` (or none);
    in mode ``released`` the largest capture keeps its output only when ``forecast`` says so and
    nothing is ``captured`` yet."""
    source, buffer_reason = _buffer(shared_buffer, engine, forecast)
    reserve, pool_reason = _pool(pool_reserve, engine, forecast)
    keeps = resolution.mode == RELEASED and not captured and forecast is not None and forecast.released_keeps_largest
    return SessionPlan(resolution, source, buffer_reason, guard=guard, guard_armed=guard and guard_supported(),
                       engine=engine, strict=strict, check_inputs=check_inputs, released_keeps_largest=bool(keeps),
                       pool_reserve_bytes=reserve, pool_reason=pool_reason)
