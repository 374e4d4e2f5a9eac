"""Keep CUDA-graph destructors out of CUDA-graph captures.

A backend dropped without ``cleanup()`` while it sits in a reference cycle is freed by the
cyclic garbage collector, at whatever moment a collection happens to run. If that moment falls
inside another graph's capture, the dropped graphs' destructors (``cudaGraphExecDestroy``, pool
release) run on a capturing process and invalidate the capture ("operation not permitted when
stream is capturing", then ``CUBLAS_STATUS_INTERNAL_ERROR`` or
``cudaErrorStreamCaptureInvalidated``). Two defences, for every capture this package makes:

* :func:`gc_safe_capture` — outermost entry (no capture of this process in progress, any
  thread): ``gc.collect()``, so garbage dies *now*, outside the capture, then ``gc.disable()``,
  so no automatic collection starts during it; the last exit restores the previous enabled flag.
  The GC's frozen generation is never touched: ``gc.freeze()`` cannot be undone selectively, so
  freezing would leave a caller's earlier freeze (SGLang's ``freeze_gc``, or any other)
  covering our objects for good — dropped backends then never die;
* :func:`defer_release` — every object that owns CUDA graphs (``engines.cuda.FullGraph``,
  ``engines.cuda_segments.CudaSegments``, the engines' pool anchors) hands its graphs here from its
  ``__del__``. Outside a capture nothing happens and the graphs go with their owner; inside one
  (ours, or the current stream capturing) they are parked and destroyed when the last capture
  ends. So even an explicit ``gc.collect()`` inside a capture, or dropping the last reference,
  frees the backend without destroying a graph on a capturing process.

Nested and concurrent captures (other threads) share one depth count, since the GC is global.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterable, Iterator
from typing import Any

_lock = threading.RLock()  # a finalizer run by gc.collect() may enter again
_depth = 0
_restore_enabled = False
_parked: list[Any] = []  # graphs whose owner died during a capture


def capture_in_progress() -> bool:
    """Whether any thread of this process is inside :func:`gc_safe_capture`."""
    return _depth > 0


def _stream_capturing() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing())
    except Exception:  # noqa: BLE001 - interpreter shutdown, no CUDA: nothing is capturing
        return False


def defer_release(graphs: Iterable[Any]) -> None:
    """Called by a dying owner of ``graphs``: keep them alive while a capture is in progress.

    Outside a capture this does nothing (the caller's references go, the graphs are destroyed
    as usual). Never raises: it runs from ``__del__``.
    """
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
    """Collect garbage, then disable the cyclic GC for the duration of a capture.

    ``collect=False`` (outermost entry only) disables the GC without the collection: for
    captures released before anything else runs (the forecast's probes), where a full collection
    would cost more than the captures (docs/index.md, "GC safety"). Nested entries
    never collect; graphs dropped meanwhile are parked as always (:func:`defer_release`).
    """
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
