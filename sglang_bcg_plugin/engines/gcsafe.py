"""Keep Python's cyclic GC away from CUDA-graph captures.

A backend dropped without ``cleanup()`` while it sits in a reference cycle is freed by the
cyclic garbage collector, at whatever moment a collection happens to run. If that moment falls
inside another graph's capture, the dropped graphs' destructors (``cudaGraphExecDestroy``, pool
release) run on a capturing process and invalidate the capture ("operation not permitted when
stream is capturing", then ``CUBLAS_STATUS_INTERNAL_ERROR`` or
``cudaErrorStreamCaptureInvalidated``). ``torch.cuda.graph`` collects before it captures and
SGLang freezes the GC around its capture loop; :func:`gc_safe_capture` does both, once, for every
capture this package makes.

Outermost entry (no capture of this process in progress, any thread): ``gc.collect()`` so
garbage dies *now*, outside the capture; then ``gc.freeze()`` so even an explicit
``gc.collect()`` inside the capture cannot reach an object that existed before it, and
``gc.disable()`` so no automatic collection starts. The last exit restores exactly the previous
state: ``gc.unfreeze()`` and the previous enabled flag. When objects are already frozen on entry
(someone else called ``gc.freeze()``, e.g. SGLang's ``freeze_gc``), the freeze is still made —
their freeze does not cover objects made since, such as a backend dropped later (seen on the
H200: skipping the freeze let ``gc.collect()`` inside a capture destroy graphs) — and the
permanent generation is left frozen on exit, because ``gc.unfreeze()`` cannot tell their objects
from ours. Frozen objects are still freed by reference counting; only cyclic garbage made
during such a capture waits for their ``gc.unfreeze()``.
Nested and concurrent captures (other threads) share one depth count, since the GC is global.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.RLock()  # a finalizer run by gc.collect() may enter again
_depth = 0
_restore_enabled = False
_unfreeze = False


def capture_in_progress() -> bool:
    """Whether any thread of this process is inside :func:`gc_safe_capture`."""
    return _depth > 0


@contextlib.contextmanager
def gc_safe_capture() -> Iterator[None]:
    """Collect garbage, then freeze and disable the cyclic GC for the duration of a capture."""
    global _depth, _restore_enabled, _unfreeze
    with _lock:
        if _depth == 0:
            gc.collect()
            _restore_enabled = gc.isenabled()
            _unfreeze = gc.get_freeze_count() == 0
            gc.freeze()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                if _unfreeze:
                    gc.unfreeze()
                if _restore_enabled:
                    gc.enable()
                else:
                    gc.disable()
