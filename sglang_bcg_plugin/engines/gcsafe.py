"""Keep CUDA-graph destructors out of CUDA-graph captures (docs/index.md#gc-safety): one
collection, then no cyclic GC while any capture runs; graphs dropped inside a capture parked."""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import torch

_lock = threading.RLock()  # a finalizer run by gc.collect() may enter again
_depth = 0
_restore_enabled = False
_parked: list[Any] = []  # graphs whose owner died during a capture


def capture_in_progress() -> bool:
    """Whether any thread of this process is inside :func:`gc_safe_capture`."""
    return _depth > 0


def _stream_capturing() -> bool:
    try:
        return bool(torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing())
    except Exception:  # noqa: BLE001 - interpreter shutdown, no CUDA: nothing is capturing
        return False


def defer_release(graphs: Iterable[Any]) -> None:
    """From a dying owner's ``__del__``: park ``graphs`` while a capture is in progress; never raises."""
    try:
        if _depth > 0 or _stream_capturing():
            with _lock:
                _parked.extend(g for g in graphs if g is not None)
    except Exception:  # noqa: BLE001,S110 - a finalizer must not raise
        pass


def parked_count() -> int:
    """Graphs waiting for the end of a capture to be destroyed."""
    return len(_parked)


def _drain() -> None:
    if _parked and not _stream_capturing():
        _parked.clear()  # not capturing any more: the destructors may run now


@contextlib.contextmanager
def gc_safe_capture(*, collect: bool = True) -> Iterator[None]:
    """Collect garbage (unless not ``collect``), then disable the cyclic GC until the outermost exit
    restores it; nested and concurrent entries share one depth count."""
    global _depth, _restore_enabled
    with _lock:
        if _depth == 0:
            if collect:
                gc.collect()
            _drain()
            _restore_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                if _restore_enabled:
                    gc.enable()
                _drain()
