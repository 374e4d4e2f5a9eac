"""``CaptureState``: the one capture core — sessions, output policy, guard, per-key records, report.

Every backend uses it: :class:`~.base.CaptureBackend` around its own engines, and the SGLang
integration around SGLang's engine (the breakable segment engine, or SGLang 0.5.13's breakable
runner), which only translates SGLang's keys, rows, pool and warmups. In the order capture runs:

1. :meth:`open` a session with a resolved mode (``off``/``on``/``released``);
2. per key: :meth:`reserve` (the last warmup's output, outside the capture), then inside the
   capture :meth:`place` (the in-graph copy into the shared buffer, or the key's own output), then
   after the capture :meth:`commit` (records the key, returns the output to hand out: a released
   alias in mode ``released``);
3. :meth:`close`; at replay :meth:`hand_out` (the stale-output guard); :meth:`report`; :meth:`clear`.

Nothing here knows which engine recorded the graph: the caller passes the graph object (its
segment count for another engine's graph). :class:`KeyPlacement` is one key's policy as our
engines drive it (``engines.base.OutputPolicy``).
"""

from __future__ import annotations

import dataclasses

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from ..errors import CaptureStateError, warn_user
from ..guard import StaleOutputGuard, guard_supported
from ..output_mode import ON, RELEASED, OutputMode, Resolution
from ..released import POOL_GUARD, release_output
from ..report import KeyReport, MemoryReport, claim_resident_bytes
from ..sharing import OutputSharer, Prepared
from .plan import SessionPlan
from ..scan import walk_tensors
from ..trees import collect_tensors, storage_key


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
    """``BackendOptions.debug_check_inputs`` at replay: the inputs still where the graph reads them.

    :raises RuntimeError: an input tensor of ``key`` has another data pointer than at capture, or
        is gone (names the key and the input's path).
    """
    if entry.input_ptrs is None:
        return
    now = dict(input_pointers(entry.capture_inputs))
    for path, ptr in entry.input_ptrs:
        found = now.get(path)
        if found != ptr:
            where = "is gone" if found is None else f"moved from data_ptr {ptr:#x} to {found:#x}"
            msg = (
                f"replay({key!r}): static input {path} {where} since capture; the graph still reads "
                "the capture-time address: copy new values into the captured tensor in place "
                "(debug_check_inputs)"
            )
            raise RuntimeError(msg)


def make_guard(enabled: bool, current: StaleOutputGuard | None) -> StaleOutputGuard | None:
    """The stale-output guard for a new session (kept across sessions while enabled).

    Where this torch build cannot poison storages the guard warns once and does nothing.
    """
    if not enabled:
        return None
    if not guard_supported():
        if current is None:
            warn_user(
                "stale_output_guard is on but this torch build cannot poison storages "
                "(needs torch._C._set_storage_access_error_msg, present in CUDA builds); "
                "the guard does nothing",
                RuntimeWarning,
            )
        return None
    return current if current is not None else StaleOutputGuard()


def key_reports(entries: list[_Entry]) -> list[KeyReport]:
    """One report per captured key (a storage is charged to the first key holding it)."""
    seen: set[tuple[str, int]] = set()
    return [
        KeyReport(
            key=entry.key,
            logical_output_bytes=entry.logical_bytes,
            resident_output_bytes=0 if entry.released else claim_resident_bytes(entry.graph.output, seen),
            shared=entry.shared,
            fallback=entry.fallback,
            capture_seconds=entry.seconds,
            graph_memory_bytes=entry.memory_bytes,
            num_segments=entry.graph.num_segments,
        )
        for entry in entries
    ]


@dataclass(eq=False)
class ForeignGraph:
    """A graph recorded by another engine, as :func:`key_reports` reads it."""

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
    plan: SessionPlan
    sharer: OutputSharer
    #: ``plan.released_keeps_largest`` until the session's first capture (the largest) kept its output
    keep_first: bool = False


def input_storages(capture_inputs: object) -> frozenset[tuple[str, int]]:
    """Storages of static inputs (any object), never adopted as a shared buffer."""
    return frozenset(storage_key(t) for t in collect_tensors(capture_inputs))


class KeyPlacement:
    """One key's output policy as an engine drives it (``engines.base.OutputPolicy``): the
    engine reserves from the last warmup's output, then places the output inside the capture;
    the backend commits :attr:`prepared` once the capture succeeded."""

    def __init__(self, state: CaptureState, key: Hashable, capture_inputs: Any) -> None:
        self.state, self.key, self.capture_inputs = state, key, capture_inputs
        self.foreign: frozenset[tuple[str, int]] | None = frozenset()
        self.prepared: Prepared | None = None

    def reserve(self, warmup_output: Any) -> None:
        self.state.reserve(self.key, warmup_output)

    def place(self, output: Any) -> Any:
        self.prepared = self.state.place(self.key, output, self.capture_inputs, self.foreign)
        return self.prepared.output


class CaptureState:
    """Output policy, guard, per-key records and report of one backend (see the module doc)."""

    def __init__(self, name: str, engine: str) -> None:
        self.name = name
        self.engine = engine
        self._open: _Open | None = None
        self._entries: dict[Hashable, _Entry] = {}
        self.guard: StaleOutputGuard | None = None
        self.plan: SessionPlan | None = None  # of the latest session
        self.forecast: Any = None  # forecast.probe.GraphMemoryForecast of the next/last schedule
        self.measured_graph_bytes: int | None = None  # device memory the last session took

    # -- session ---------------------------------------------------------------------------
    def open(self, plan: SessionPlan) -> None:
        """Start a session with ``plan`` (:func:`~.plan.plan_session`): a fresh sharer for its
        mode; the guard read now serves every replay from now on.

        :raises CaptureStateError: a session is already open.
        """
        if self._open is not None:
            msg = f"{self.name} backend: capture_session() is already open; sessions do not nest"
            raise CaptureStateError(msg)
        sharer = OutputSharer(enabled=plan.mode == ON, strict=plan.strict, source=plan.buffer_source)
        self.guard = make_guard(plan.guard, self.guard)
        self._open = _Open(plan, sharer, keep_first=plan.released_keeps_largest)
        self.plan = plan

    def close(self) -> None:
        self._open = None

    @property
    def mode_active(self) -> OutputMode | None:
        return None if self._open is None else self._open.plan.mode

    @property
    def resolution(self) -> Resolution | None:
        """The output mode of the latest session and why."""
        return None if self.plan is None else self.plan.resolution

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

    def place(
        self, key: Hashable, output: Any, capture_inputs: Any = None, foreign: frozenset[tuple[str, int]] | None = frozenset()
    ) -> Prepared:
        """Inside the capture: how ``key``'s output is held (in-graph copy, adopt or own).

        :param foreign: storages the forward returned but did not allocate (never adopted);
            ``None``: unknown, so nothing is adopted (``engines.base.run_warmups``).
        """
        return self._session(key).sharer.prepare(key, output, input_storages(capture_inputs), foreign)

    def commit(
        self,
        key: Hashable,
        prepared: Prepared,
        *,
        graph: Any,
        num_segments: int | None = None,
        capture_inputs: Any = None,
        seconds: float | None = None,
        memory_bytes: int | None = None,
        can_release: bool = True,
    ) -> Any:
        """After a successful capture: record ``key``; return the output to hand out.

        ``graph`` is another engine's graph (give ``num_segments``) or one of ours, an
        ``engines.base.CapturedGraph`` (``num_segments=None``: it replays and hands out the output
        itself). In mode ``released`` (where ``can_release``: graph-pool memory) the output is a
        non-owning alias and ``prepared.output`` is dropped; the caller must drop its own
        references too for the memory to return to the pool. The first capture of a session
        that keeps it (:meth:`open`) hands out its own output, as mode ``off`` does.
        """
        session = self._session(key)
        prepared.commit()
        released = session.plan.mode == RELEASED and can_release and not session.keep_first
        session.keep_first = False
        output = release_output(prepared.output) if released else prepared.output
        if released:
            prepared.output = None
        if num_segments is None:
            graph.output = output
            held = graph
        else:
            held = ForeignGraph(graph, None if released else output, num_segments)
        self._entries[key] = _Entry(
            key,
            held,
            capture_inputs,
            prepared.shared,
            prepared.fallback,
            prepared.logical_bytes,
            seconds=seconds,
            memory_bytes=memory_bytes,
            released=released,
            input_ptrs=input_pointers(capture_inputs) if session.plan.check_inputs else None,
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

    def entry(self, key: Hashable) -> _Entry | None:
        """The record of ``key`` (``None``: not captured)."""
        return self._entries.get(key)

    def report(self, bridge_bytes: dict[int | None, int] | None = None) -> MemoryReport:
        """Logical vs resident output bytes, fallbacks and capture seconds, per key."""
        entries = list(self._entries.values())
        report = MemoryReport.from_keys(self.name, self.engine, key_reports(entries), bridge_bytes=bridge_bytes)
        return dataclasses.replace(report, plan=self.plan, forecast=self.forecast, measured_graph_bytes=self.measured_graph_bytes)

    def clear(self, owner: object = None) -> None:
        """Forget every record (the graphs are the engine's to destroy)."""
        for entry in self._entries.values():
            entry.graph.release()
        self._entries.clear()
        self.forecast = None
        self.measured_graph_bytes = None
        if self.guard is not None:
            self.guard.clear()
        if owner is not None:
            POOL_GUARD.forget(owner)

