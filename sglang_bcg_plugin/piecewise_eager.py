"""Eager engine of the piecewise backend: CUDA-graph semantics per piece, without CUDA.

Runs ``num_warmups`` eager forwards (each followed by ``post_warmup_hook``), then one recorded
forward (``piecewise_record``): each piece runs and its outputs become static storage; replay
re-runs the pieces in order and writes into that storage, with the splitting ops eager between
them, exactly as CUDA-graph pieces would. One bridge arena per stream partition.
"""

from __future__ import annotations

import functools

from .engines.base import CaptureRequest, run_warmups
from .engines.segments import BridgeArena
from .piecewise_record import Action, PiecewiseGraph, PieceRecorder, record


class EagerSegments:
    """Segments of the eager engine: the recorded actions, re-run in order at replay."""

    def __init__(self) -> None:
        self._done: list[list[Action]] = []
        self._current: list[Action] | None = None

    def begin(self) -> None:
        self._current = []

    def end(self) -> None:
        assert self._current is not None
        self._done.append(self._current)
        self._current = None

    def record(self, action: Action) -> None:
        assert self._current is not None
        self._current.append(action)

    def abort(self) -> None:
        self._current = None
        self._done.clear()

    def runners(self) -> list[Action | None]:
        return [functools.partial(_run_all, acts) if acts else None for acts in self._done]

    def release(self) -> None:
        self._done.clear()


def _run_all(actions: list[Action]) -> None:
    for action in actions:
        action()


class PiecewiseEagerEngine:
    """Pieces re-run at replay and write into their captured outputs (no CUDA needed)."""

    name = "eager"

    def __init__(self) -> None:
        self._arenas: dict[int | None, BridgeArena] = {}

    def arena(self, partition: int | None) -> BridgeArena:
        if partition not in self._arenas:
            self._arenas[partition] = BridgeArena()
        return self._arenas[partition]

    def capture(self, request: CaptureRequest, known_inputs: frozenset[tuple[str, int]] = frozenset()) -> PiecewiseGraph:
        run_warmups(request)
        recorder = PieceRecorder(request.key, EagerSegments(), self.arena(request.partition), known_inputs)
        return record(recorder, request.forward_fn, request.finalize)

    def release(self) -> None:
        self._arenas.clear()
