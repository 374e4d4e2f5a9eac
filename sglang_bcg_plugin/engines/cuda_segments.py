"""CUDA-graph primitives of every capture: segments, end, abort (CUDA only)."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch

from .gcsafe import defer_release
from .recorder import Action


def end_capture(graph: torch.cuda.CUDAGraph, pool: Any = None) -> bool:
    """End a capture; ``False``: it captured no work. :raises RuntimeError: invalidated (can capture again)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            graph.capture_end()
        except Exception:
            _recover(pool)
            raise
    others = [w for w in caught if "empty" not in str(w.message).lower()]
    for w in others:  # pragma: no cover - re-emit anything unexpected
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return len(others) == len(caught)


def abort_capture(graph: torch.cuda.CUDAGraph, pool: Any) -> None:
    """End a failed capture so the process can capture again; the graph is discarded (an invalidated
    capture's ``capture_end`` raises first: :func:`_recover`, docs/refusals.md)."""
    try:
        graph.capture_end()
    except Exception:  # noqa: BLE001 - the capture is already invalid; the caller re-raises
        _recover(pool)
    with contextlib.suppress(Exception):
        graph.reset()


#: Pools whose capture was invalidated (handles are never reused: ``graph_pool_handle`` counts up).
_INVALIDATED: set[Any] = set()


def invalidated(pool: Any) -> bool:
    """Whether a capture into ``pool`` was invalidated (nothing more is captured there)."""
    return pool is not None and _as_key(pool) in _INVALIDATED


def _as_key(pool: Any) -> Any:
    return tuple(pool) if isinstance(pool, (list, tuple)) else pool


def _recover(pool: Any) -> None:
    """After a ``capture_end`` that raised: end the allocator's recording into ``pool`` and the
    generators' capture mode, which it left open; mark ``pool`` :func:`invalidated`."""
    if pool is not None:
        _INVALIDATED.add(_as_key(pool))
    _end_pool_recording(pool)
    _leave_generator_capture()


def _end_pool_recording(pool: Any) -> None:
    device = torch.cuda.current_device()
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    release = getattr(torch._C, "_cuda_releasePool", None)
    if end is None or pool is None:
        return
    # The allocator may hold more than one recording for the pool: end each, and give back the
    # use count its capture_begin took (the failed graph's reset() does not: it never ended).
    for _ in range(8):
        try:
            end(device, pool)
        except Exception:  # noqa: BLE001 - "not currently recording": none is left
            break
        if release is not None:
            with contextlib.suppress(Exception):
                release(device, pool)


def _leave_generator_capture() -> None:
    """Take every CUDA generator out of capture mode; where the default generator still refuses,
    give it a fresh state with the same seed and offset."""
    with contextlib.suppress(Exception):
        reset = torch.cuda.CUDAGraph()
        reset.capture_begin(pool=torch.cuda.graph_pool_handle())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "the CUDA Graph is empty"
            reset.capture_end()
        reset.reset()
    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    offset = gen.get_offset()
    try:
        torch.rand(1, device="cuda", generator=gen)
    except RuntimeError:
        fresh = torch.Generator(device="cuda")
        fresh.manual_seed(gen.initial_seed())
        fresh.set_offset(offset)
        gen.graphsafe_set_state(fresh)
    else:
        gen.set_offset(offset)  # the probe draws nothing the user sees


class CudaSegments:
    """Each segment is one ``torch.cuda.CUDAGraph`` in the partition's pool (None if empty)."""

    reruns_actions = False  # the kernels are in the graphs

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.graphs: list[torch.cuda.CUDAGraph | None] = []
        self._current: torch.cuda.CUDAGraph | None = None

    def begin(self) -> None:
        g = torch.cuda.CUDAGraph()
        g.capture_begin(pool=self.pool)
        self._current = g

    def end(self) -> None:
        g, self._current = self._current, None
        assert g is not None
        self.graphs.append(g if end_capture(g, self.pool) else None)

    def record(self, action: Action) -> None:
        """Nothing to do: the kernels are in the open graph."""

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """Nothing to pause: a CUDA graph records every kernel on the capturing stream."""
        return contextlib.nullcontext()

    def watched(self) -> contextlib.AbstractContextManager[None]:
        """Nothing to watch: the stream capture itself refuses a host sync."""
        return contextlib.nullcontext()

    def abort(self) -> None:
        if self._current is not None:
            abort_capture(self._current, self.pool)
            self._current = None
        self.release()

    def runners(self) -> list[Action | None]:
        return [None if g is None else g.replay for g in self.graphs]

    def release(self) -> None:
        for g in self.graphs:
            if g is not None:
                g.reset()
        self.graphs.clear()

    def __del__(self) -> None:  # dropped inside a capture: destroyed after it
        defer_release([*getattr(self, "graphs", ()), getattr(self, "_current", None)])
