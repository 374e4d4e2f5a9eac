"""Bookkeeping of :class:`~.base.CaptureBackend`: sessions, captured entries, guard, report."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

from ..engines.base import CapturedGraph, Engine
from ..errors import warn_user
from ..guard import StaleOutputGuard, guard_supported
from ..output_mode import OutputMode
from ..report import KeyReport, MemoryReport, claim_resident_bytes
from ..sharing import BufferSource, OutputSharer


@dataclass(eq=False)
class _Session:
    share_output: bool
    sharer: OutputSharer
    stream: Any
    mode: OutputMode = "off"


@dataclass(eq=False)
class _Entry:
    key: Hashable
    graph: CapturedGraph
    capture_inputs: Any
    shared: bool
    share_output: bool
    fallback: str | None
    logical_bytes: int
    seconds: float | None = None
    memory_bytes: int | None = None
    released: bool = False  # outputs are non-owning aliases of pool memory: nothing resident


def use_cuda(engine: str, backend: str) -> bool:
    """Whether a backend with option ``engine`` captures real CUDA graphs here."""
    if engine == "eager":
        return False
    if engine == "cuda" and not torch.cuda.is_available():
        msg = f"{backend} backend: engine='cuda' but CUDA is not available; use 'auto' or 'eager'"
        raise RuntimeError(msg)
    return torch.cuda.is_available()


def buffer_source(choice: str, engine: Engine) -> BufferSource:
    """Where shared output buffers come from: the option; with ``"auto"``, a buffer reserved
    before capture on CUDA and adoption on the eager engine (no pool to fragment there).

    Measured on an H200 (docs/benchmarks.md), a reserved buffer costs exactly one output over
    the floor on every engine and model; adopting the largest output costs anywhere from nothing
    to 1.4 outputs, depending on where the allocator placed it among the largest forward's
    activations — so ``"auto"`` takes the bound that always holds.
    """
    if choice in ("adopt", "reserve"):
        return choice  # type: ignore[return-value]
    return "reserve" if engine.name == "cuda" else "adopt"


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


def report_of(backend: str, engine: Engine | None, entries: list[_Entry]) -> MemoryReport:
    """The memory report of a backend's captured entries (storages charged to their first key)."""
    seen: set[tuple[str, int]] = set()
    keys = []
    for entry in entries:
        resident = 0 if entry.released else claim_resident_bytes(entry.graph.output, seen)
        keys.append(
            KeyReport(
                key=entry.key,
                logical_output_bytes=entry.logical_bytes,
                resident_output_bytes=resident,
                shared=entry.shared,
                fallback=entry.fallback,
                capture_seconds=entry.seconds,
                graph_memory_bytes=entry.memory_bytes,
                num_segments=entry.graph.num_segments,
            )
        )
    if engine is None:
        return MemoryReport.from_keys(backend, "none", keys)
    return MemoryReport.from_keys(backend, engine.name, keys, bridge_bytes=engine.bridge_bytes())
