"""``CaptureState``: the one capture core of every backend (ours and the SGLang integration's):
the session, per-key records, the replay hand-out and the report."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from ..errors import CaptureStateError
from .guard import GUARD
from .mode import OutputMode, Resolution
from .report import KeyReport, MemoryReport, claim_resident_bytes
from .scan import walk_tensors
from .policy import OutputPolicy
from .trees import collect_tensors, storage_key
from .plan import SessionPlan


@dataclass(eq=False)
class _Entry:
    """The record of one captured key."""

    key: Hashable
    graph: Any  # engines.base.CapturedGraph, or a ForeignGraph
    capture_inputs: Any
    shared: bool
    fallback: str | None
    logical_bytes: int
    seconds: float | None = None
    memory_bytes: int | None = None
    released: bool = False  # outputs are non-owning aliases of pool memory: nothing resident
    #: ``BackendOptions.debug_check_inputs``: each input tensor's path and capture-time data pointer
    input_ptrs: tuple[tuple[str, int], ...] | None = None


def input_pointers(capture_inputs: object) -> tuple[tuple[str, int], ...]:
    """Every tensor of ``capture_inputs`` as ``(path, data_ptr)``, in walk order."""
    return tuple((path, t.data_ptr()) for path, t in walk_tensors(capture_inputs, "capture_inputs"))


def check_input_pointers(key: Hashable, entry: _Entry) -> None:
    """``debug_check_inputs`` at replay. :raises RuntimeError: an input tensor of ``key`` moved or is gone."""
    if entry.input_ptrs is None:
        return
    now = dict(input_pointers(entry.capture_inputs))
    for path, ptr in entry.input_ptrs:
        found = now.get(path)
        if found != ptr:
            where = "is gone" if found is None else f"moved from data_ptr {ptr:#x} to {found:#x}"
            msg = (f"replay({key!r}): static input {path} {where} since capture; the graph still reads the "
                   "capture-time address: copy new values into the captured tensor in place (debug_check_inputs)")
            raise RuntimeError(msg)


def _key_fields(key: object) -> list[str]:
    """The fields of a shape key beside ``size`` (a dataclass's, else ``stream_idx`` and ``variant_label``)."""
    if dataclasses.is_dataclass(key):
        return [f.name for f in dataclasses.fields(key) if f.name != "size"]
    return [name for name in ("stream_idx", "variant_label") if hasattr(key, name)]


def _fields_text(key: object, names: list[str]) -> str:
    return ", ".join(f"{name}={getattr(key, name, None)!r}" for name in names)


def _same_size(key: Hashable, captured: list[Hashable]) -> str:
    """What ``key``'s size was captured with instead: the fields that differ, or another key type."""
    size = getattr(key, "size", None)
    same = [k for k in captured if getattr(k, "size", None) == size and type(k) is type(key)]
    varying = [n for n in _key_fields(key) if any(getattr(k, n, None) != getattr(key, n, None) for k in same)]
    if varying:
        combos = list(dict.fromkeys(_fields_text(k, varying) for k in same))
        asked = _fields_text(key, varying)
        if len(varying) > 1:
            combos, asked = [f"({c})" for c in combos], f"({asked})"
        return (f": size {size} was captured for {', '.join(combos)} but not for {asked} (a key that differs in any "
                "field has graphs of its own: capture the size for it too, or replay a captured key)")
    others = sorted({type(k).__qualname__ for k in captured
                     if getattr(k, "size", None) == size and type(k) is not type(key)})
    if others:
        return (f": size {size} was captured with another key type ({', '.join(others)}), and keys are told apart by "
                "their own equality: replay with the key type the size was captured with")
    return ""


def _sizes_per_stream(key: Hashable, captured: list[Hashable]) -> str:
    """The captured sizes per ``stream_idx`` (``key``'s too), where another stream than ``key``'s has some."""
    streams: dict[object, set[int]] = {}
    for k in captured:
        streams.setdefault(getattr(k, "stream_idx", None), set()).add(getattr(k, "size", 0))
    stream = getattr(key, "stream_idx", None)
    if not captured or set(streams) == {stream}:
        return ""
    order = sorted({*streams, stream}, key=lambda s: (s is not None, s if isinstance(s, int) else 0))
    return " (" + "; ".join(f"stream_idx={s!r}: {sorted(streams.get(s, ())) or 'none'}" for s in order) + ")"


def never_captured(key: Hashable, captured: list[Hashable]) -> str:
    """Why ``key`` is not among ``captured``: the fields (stream, variant label, ...) its size was captured
    with instead, then the captured sizes (per stream where another stream than ``key``'s has some)."""
    sizes = sorted({getattr(k, "size", 0) for k in captured})
    return f"{_same_size(key, captured)}; captured sizes: {sizes or 'none'}{_sizes_per_stream(key, captured)}"


@dataclass(eq=False)
class ForeignGraph:
    """A graph recorded by another engine (replayed by it), as :meth:`CaptureState.report` reads it."""

    graph: Any
    output: Any
    num_segments: int

    def release(self) -> None:
        self.graph = self.output = None


def input_storages(capture_inputs: object) -> frozenset[tuple[str, int]]:
    """Storages of static inputs (any object), never adopted as a shared buffer."""
    return frozenset(storage_key(t) for t in collect_tensors(capture_inputs))


class CaptureState:
    """Session, per-key records, replay hand-out and report of one backend: :meth:`open`, per key
    :meth:`begin`, the engine drives :attr:`policy`, :meth:`commit`; :meth:`close`; :meth:`hand_out`."""

    def __init__(self, name: str, engine: str) -> None:
        self.name, self.engine = name, engine
        self.policy = OutputPolicy()
        self._open: SessionPlan | None = None
        self._entries: dict[Hashable, _Entry] = {}
        self.plan: SessionPlan | None = None  # of the latest session
        self.forecast: Any = None  # forecast.probe.GraphMemoryForecast of the next/last schedule
        self.measured_graph_bytes: int | None = None  # device memory the last session took

    def open(self, plan: SessionPlan, resume: bool = False) -> None:
        """``resume``: the session adds sizes to the last one's (:meth:`OutputPolicy.open`).
        :raises CaptureStateError: a session is already open."""
        if self._open is not None:
            raise CaptureStateError(f"{self.name} backend: capture_session() is already open; sessions do not nest")
        self.policy.open(plan, resume)
        self._open = self.plan = plan

    def close(self) -> None:
        self.policy.close()
        self._open = None

    @property
    def mode_active(self) -> OutputMode | None:
        return None if self._open is None else self._open.mode

    @property
    def resolution(self) -> Resolution | None:
        """The output mode of the latest session and why."""
        return None if self.plan is None else self.plan.resolution

    def begin(self, key: Hashable) -> SessionPlan:
        """The open session's plan. :raises CaptureStateError: no session is open."""
        if self._open is None:
            msg = f"{self.name} backend: capture_one({key!r}) must run inside `with backend.capture_session():`"
            raise CaptureStateError(msg)
        return self._open

    def commit(self, key: Hashable, *, graph: Any, num_segments: int | None = None, capture_inputs: Any = None,
               seconds: float | None = None, memory_bytes: int | None = None, can_release: bool = True) -> Any:
        """Commit ``key``'s placement and record the key; returns the output to hand out. ``graph``: one
        of ours (``num_segments=None``: its ``output`` is set here) or another engine's. The caller
        drops its own references to the placed output (a released output is a non-owning alias).
        :raises CaptureStateError: no session is open."""
        session = self.begin(key)
        placed = self.policy.commit(key, can_release=can_release)
        if num_segments is None:
            graph.output = placed.output
            held = graph
        else:
            held = ForeignGraph(graph, None if placed.released else placed.output, num_segments)
        self._entries[key] = _Entry(key, held, capture_inputs, placed.shared, placed.fallback, placed.logical_bytes,
                                    seconds=seconds, memory_bytes=memory_bytes, released=placed.released,
                                    input_ptrs=input_pointers(capture_inputs) if session.check_inputs else None)
        return placed.output

    def hand_out(self, key: Hashable, output: Any, *, pool: Hashable | None = None) -> Any:
        """A replayed output of captured ``key`` through the stale-output guard, scoped by ``pool``
        (``None``: one pool per partition)."""
        entry = self._entries[key]
        guard = self.policy.guard
        return output if guard is None else guard.hand_out(self, key, output, released=entry.released, pool=pool)

    def keys(self) -> list[Hashable]:
        return list(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def entry(self, key: Hashable) -> _Entry:
        """The record of ``key``. :raises KeyError: ``key`` was never captured (naming the captured sizes)."""
        try:
            return self._entries[key]  # one lookup: this is on the replay path
        except KeyError:
            msg = f"{key!r} was never captured by the {self.name} backend{never_captured(key, list(self._entries))}"
            raise KeyError(msg) from None

    def report(self, bridge_bytes: dict[int | None, int] | None = None) -> MemoryReport:
        """The memory report: per key (a storage is charged to the first key holding it), with the plan."""
        seen: set[tuple[str, int]] = set()
        keys = [
            KeyReport(key=e.key, logical_output_bytes=e.logical_bytes,
                      resident_output_bytes=0 if e.released else claim_resident_bytes(e.graph.output, seen),
                      shared=e.shared, fallback=e.fallback, capture_seconds=e.seconds,
                      graph_memory_bytes=e.memory_bytes, num_segments=e.graph.num_segments)
            for e in self._entries.values()
        ]
        report = MemoryReport.from_keys(self.name, self.engine, keys, bridge_bytes=bridge_bytes)
        return dataclasses.replace(report, plan=self.plan, forecast=self.forecast,
                                   measured_graph_bytes=self.measured_graph_bytes)

    def clear(self) -> None:
        """Forget every record and the guard's (the graphs are the engine's to destroy)."""
        for entry in self._entries.values():
            entry.graph.release()
        self._entries.clear()
        self.policy.forget()
        self.forecast = None
        self.measured_graph_bytes = None
        GUARD.forget(self)
