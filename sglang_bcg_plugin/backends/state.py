"""``CaptureState``: the capture core for a backend whose graphs another engine records.

:class:`~.base.CaptureBackend` owns its engine; an integration that captures through someone
else's engine (SGLang's breakable segment engine, or SGLang 0.5.13's breakable runner) still
needs the same output policy, guard, per-key records and report. This class is that state, built
from the same pieces :mod:`.session` gives :class:`~.base.CaptureBackend` (``_Entry``,
``make_guard``, ``report_of``) and :class:`~sglang_bcg_plugin.sharing.OutputSharer`, in the order
capture runs:

1. :meth:`open` a session with a resolved mode (``off``/``on``/``released``);
2. per key: :meth:`reserve` (the last warmup's output, outside the capture), then inside the
   capture :meth:`place` (the in-graph copy into the shared buffer, or the key's own output), then
   after the capture :meth:`commit` (records the key, returns the output to hand out: a released
   alias in mode ``released``);
3. :meth:`close`; at replay :meth:`hand_out` (the stale-output guard); :meth:`report`; :meth:`clear`.

Nothing here knows which engine recorded the graph: the caller passes the graph object and its
segment count.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from ..errors import CaptureStateError
from ..guard import StaleOutputGuard
from ..output_mode import ON, RELEASED, OutputMode, Resolution
from ..released import POOL_GUARD, release_output
from ..report import MemoryReport
from ..sharing import BufferSource, OutputSharer, Prepared
from ..trees import collect_tensors, storage_key
from .session import _Entry, make_guard, report_of


@dataclass(eq=False)
class ForeignGraph:
    """A graph recorded by another engine, as :func:`.session.report_of` reads it."""

    graph: Any
    output: Any
    num_segments: int

    def replay(self) -> Any:  # pragma: no cover - the owning engine replays its own graphs
        msg = "a ForeignGraph is replayed by the engine that recorded it"
        raise NotImplementedError(msg)

    def release(self) -> None:
        self.graph = self.output = None


@dataclass(eq=False)
class _Open:
    resolution: Resolution
    sharer: OutputSharer
    protected: dict[Hashable, frozenset[tuple[str, int]]] = field(default_factory=dict)


def input_storages(capture_inputs: object) -> frozenset[tuple[str, int]]:
    """Storages of static inputs (any object), never adopted as a shared buffer."""
    return frozenset(storage_key(t) for t in collect_tensors(capture_inputs))


class CaptureState:
    """Output policy, guard, per-key records and report of one backend (see the module doc)."""

    def __init__(self, name: str, engine: str) -> None:
        self.name = name
        self.engine = engine
        self._open: _Open | None = None
        self._entries: dict[Hashable, _Entry] = {}
        self.guard: StaleOutputGuard | None = None
        self.resolution: Resolution | None = None  # of the latest session

    # -- session ---------------------------------------------------------------------------
    def open(self, resolution: Resolution, *, source: BufferSource, guard: bool, strict: bool = False) -> None:
        """Start a session: a fresh sharer for ``resolution.mode``; the guard read now serves
        every replay from now on.

        :raises CaptureStateError: a session is already open.
        """
        if self._open is not None:
            msg = f"{self.name}: capture_session() is already open; sessions do not nest"
            raise CaptureStateError(msg)
        sharer = OutputSharer(enabled=resolution.mode == ON, strict=strict, source=source)
        self.guard = make_guard(guard, self.guard)
        self._open = _Open(resolution, sharer)
        self.resolution = resolution

    def close(self) -> None:
        self._open = None

    @property
    def mode_active(self) -> OutputMode | None:
        return None if self._open is None else self._open.resolution.mode

    @property
    def sharer(self) -> OutputSharer | None:
        return None if self._open is None else self._open.sharer

    def _session(self, key: Hashable) -> _Open:
        if self._open is None:
            msg = f"capture_one({key!r}) must run inside `with backend.capture_session(stream):`"
            raise CaptureStateError(msg)
        return self._open

    # -- one key ---------------------------------------------------------------------------
    def begin(self, key: Hashable) -> None:
        """Check a capture of ``key`` may start (a session is open)."""
        self._session(key)

    def reserve(self, key: Hashable, output: Any, capacity_rows: int | None = None) -> None:
        """Reserve ``key``'s partition buffer from a warmup output (outside the capture)."""
        session = self._session(key)
        if output is None:
            return
        try:
            session.sharer.reserve(key, output, capacity_rows=capacity_rows)
        except TypeError:
            return  # an unsupported tensor holder: place() raises the real TypeError

    def place(self, key: Hashable, output: Any, capture_inputs: Any = None) -> Prepared:
        """Inside the capture: how ``key``'s output is held (in-graph copy, adopt or own)."""
        return self._session(key).sharer.prepare(key, output, input_storages(capture_inputs))

    def commit(
        self,
        key: Hashable,
        prepared: Prepared,
        *,
        graph: Any,
        num_segments: int,
        capture_inputs: Any = None,
        seconds: float | None = None,
    ) -> Any:
        """After a successful capture: record ``key``; return the output to hand out.

        In mode ``released`` that is a non-owning alias; the caller must drop its own references
        to ``prepared.output`` for the memory to return to the pool.
        """
        session = self._session(key)
        prepared.commit()
        released = session.resolution.mode == RELEASED
        output = release_output(prepared.output) if released else prepared.output
        self._entries[key] = _Entry(
            key,
            ForeignGraph(graph, None if released else output, num_segments),
            capture_inputs,
            prepared.shared,
            session.resolution.mode == ON,
            prepared.fallback,
            prepared.logical_bytes,
            seconds=seconds,
            released=released,
        )
        return output

    # -- replay, report, cleanup -----------------------------------------------------------
    def is_released(self, key: Hashable) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.released

    def hand_out(self, key: Hashable, output: Any, *, pool: Hashable, owner: object) -> Any:
        """A replayed output through the stale-output guard (unchanged when it is off)."""
        if self.guard is None:
            return output
        if self.is_released(key):
            return POOL_GUARD.replayed(pool, owner, key, output)
        POOL_GUARD.replayed(pool, owner, key)  # another graph of the pool ran
        return self.guard.hand_out(key, output)

    def keys(self) -> list[Hashable]:
        return list(self._entries)

    def report(self) -> MemoryReport:
        """Logical vs resident output bytes, fallbacks and capture seconds, per key."""
        return dataclasses.replace(report_of(self.name, None, list(self._entries.values())), engine=self.engine)

    def clear(self, owner: object = None) -> None:
        """Forget every record (the graphs are the engine's to destroy)."""
        for entry in self._entries.values():
            entry.graph.release()
        self._entries.clear()
        if self.guard is not None:
            self.guard.clear()
        if owner is not None:
            POOL_GUARD.forget(owner)

