"""Per-key capture time and memory accounting, as a plugin on ``sglang_bcg_capture_one``."""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING

import torch

from .manager import hookimpl

if TYPE_CHECKING:
    from .backends.base import CaptureBackend


def _reserved(backend: CaptureBackend) -> int | None:
    if backend.engine_name != "cuda":
        return None
    torch.cuda.synchronize()
    return int(torch.cuda.memory_reserved())


@hookimpl(wrapper=True)
def sglang_bcg_capture_one(
    backend: CaptureBackend, shape_key: object, capture: Callable[[], object]
) -> Generator[None, object, object]:
    """Time the capture (and the reserved-memory growth on CUDA) and hand it to the backend."""
    before = _reserved(backend)
    start = time.perf_counter()
    result = yield
    seconds = time.perf_counter() - start
    after = _reserved(backend)
    grown = None if before is None or after is None else after - before
    backend.record_capture_stats(shape_key, seconds=seconds, memory_bytes=grown)
    return result

