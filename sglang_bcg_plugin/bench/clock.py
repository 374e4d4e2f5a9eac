"""Compile time of a ``torch.compile``-d callable, apart from the work it then does."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


class CompileClock:
    """A ``torch.compile``-d callable that sums the wall time of the calls that compiled (reported
    as ``compile_s``, apart from ``capture_s``)."""

    def __init__(self, fn: Callable[..., Any], device: str) -> None:
        self.fn = fn
        self.device = device
        self.seconds = 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from torch._dynamo.utils import counters

        graphs, start = counters["stats"]["unique_graphs"], time.perf_counter()
        out = self.fn(*args, **kwargs)
        if counters["stats"]["unique_graphs"] != graphs:
            if self.device.startswith("cuda"):
                torch.cuda.synchronize()
            self.seconds += time.perf_counter() - start
        return out
