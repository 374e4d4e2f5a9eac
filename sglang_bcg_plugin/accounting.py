"""Capture accounting: per key, wall time and the growth of reserved device memory on CUDA; per
session, the device memory it took (:func:`device_free_bytes` before and after)."""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass

import torch


def _reserved(engine: str) -> int | None:
    if engine != "cuda":
        return None
    torch.cuda.synchronize()
    return int(torch.cuda.memory_reserved())


@dataclass
class Measure:
    """Times the block; ``memory_bytes``: the growth of reserved CUDA memory across it (CUDA engine only)."""

    engine: str
    seconds: float | None = None
    memory_bytes: int | None = None

    def __enter__(self) -> Measure:
        self._before = _reserved(self.engine)
        self._start = time.perf_counter()
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        self.seconds = time.perf_counter() - self._start
        after = _reserved(self.engine) if kind is None else None
        self.memory_bytes = None if self._before is None or after is None else after - self._before


def device_free_bytes(*, collect: bool = True) -> int:
    """Free device memory after ``empty_cache`` (and, with ``collect``, a ``gc.collect()`` first)."""
    if collect:
        gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return int(torch.cuda.mem_get_info()[0])
