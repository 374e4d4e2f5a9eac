"""A capture in a process that serves (a live switch, an incremental capture's step): the dummy batch SGLang
captures with writes its keys and values into the KV cache's padding slot, as at start-up, never into a live
request's.

SGLang's runners build their capture batch over their static input buffers (``capture_prepare``: the
``out_cache_loc`` slot of the process-wide input buffers, where the last replay left its batch's KV slots). At
start-up those buffers are zeros, and slot 0 is the slot SGLang reserves for the writes of padded tokens; in a
serving process they hold the last batch's slots, so the capture's warm-up and recorded forwards would write
dummy keys and values over a request still decoding (seen on an H100: the first token right, then eleven
zeros). :func:`dummy_writes_to_padding` zeroes the capture batch's ``out_cache_loc`` in place while it is open;
the graphs record the buffer's address, not its values, so what they replay is unchanged. :func:`light_gc`
skips the two full garbage collections SGLang's ``freeze_gc`` runs around every capture (a serving process
collects on its own); :func:`quiesced` keeps the device idle at the capture's start and end, so no batch in
flight overlaps it; :func:`while_serving` is all three.

A model with per-request state besides the KV cache (a mamba pool) cannot be captured while it serves: the
capture clears the state of request slots that may be live (:func:`per_request_state`)."""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import sys
from collections.abc import Iterator
from typing import Any

import torch

#: SGLang 0.5.14-0.5.23's runners whose ``capture_prepare`` builds the dummy batch (prefill, decode).
RUNNER_CLASSES = (
    "sglang.srt.model_executor.runner.prefill_cuda_graph_runner.PrefillCudaGraphRunner",
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner",
)


def runner_classes() -> list[type[Any]]:
    """The installed release's runner classes of :data:`RUNNER_CLASSES` that define ``capture_prepare``."""
    found = []
    for path in RUNNER_CLASSES:
        module, _, name = path.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
        if callable(cls.__dict__.get("capture_prepare")):
            found.append(cls)
    return found


def to_padding(prepared: Any) -> None:
    """Zero, in place, the ``out_cache_loc`` of a ``capture_prepare`` result (its forward batch, alone or first
    of a tuple)."""
    batch = prepared[0] if isinstance(prepared, tuple) and prepared else prepared
    loc = getattr(batch, "out_cache_loc", None)
    if isinstance(loc, torch.Tensor):
        loc.zero_()


@contextlib.contextmanager
def _swapped(changes: list[tuple[Any, str, Any]]) -> Iterator[None]:
    """Each ``(owner, name, value)`` set while open; the originals restored after, last first, also on error."""
    done = []
    try:
        for owner, name, value in changes:
            done.append((owner, name, getattr(owner, name)))
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, original in reversed(done):
            setattr(owner, name, original)


def _padded(original: Any) -> Any:
    @functools.wraps(original)
    def capture_prepare(self: Any, *args: Any, **kwargs: Any) -> Any:
        prepared = original(self, *args, **kwargs)
        to_padding(prepared)
        return prepared

    return capture_prepare


def dummy_writes_to_padding(classes: list[type[Any]] | None = None) -> contextlib.AbstractContextManager[None]:
    """While open, every ``capture_prepare`` of ``classes`` (default: :func:`runner_classes`) hands out its batch
    with ``out_cache_loc`` zeroed; restored after, also when the capture raises."""
    found = runner_classes() if classes is None else classes
    return _swapped([(cls, "capture_prepare", _padded(cls.__dict__["capture_prepare"])) for cls in found])


@contextlib.contextmanager
def _freeze_gc_without_collections(enable_cudagraph_gc: bool) -> Iterator[None]:
    """SGLang's ``freeze_gc`` (objects frozen while the capture runs, unless its GC is enabled) without its two full
    collections: each walks every object of the scheduler's process."""
    if not enable_cudagraph_gc:
        gc.freeze()
    try:
        yield
    finally:
        if not enable_cudagraph_gc:
            gc.unfreeze()


def light_gc(*runners: Any) -> contextlib.AbstractContextManager[None]:
    """A capture while serving uses :func:`_freeze_gc_without_collections` as the ``freeze_gc`` of the modules of
    ``runners`` (runner instances or classes; SGLang 0.5.14-0.5.23 import it there by name); restored after.
    Elsewhere: nothing changed."""
    modules = {sys.modules.get((r if isinstance(r, type) else type(r)).__module__) for r in runners}
    return _swapped([(m, "freeze_gc", _freeze_gc_without_collections) for m in modules
                     if m is not None and getattr(m, "freeze_gc", None) not in (None, _freeze_gc_without_collections)])


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


@contextlib.contextmanager
def quiesced() -> Iterator[None]:
    """The device idle when a capture starts and when it ends: the overlap scheduler's batch in flight reads the
    static buffers the capture's preparation rewrites, and the capture's last eager work (its warm-up, the breaks
    of a breakable graph) runs on SGLang's capture stream, which the next batch's forward stream does not wait
    for."""
    _synchronize()
    try:
        yield
    finally:
        _synchronize()


@contextlib.contextmanager
def while_serving(*runners: Any) -> Iterator[None]:
    """A capture in a serving process: :func:`quiesced`, :func:`dummy_writes_to_padding` and :func:`light_gc` over
    the runner classes and ``runners``."""
    classes = runner_classes()
    with quiesced(), dummy_writes_to_padding(classes), light_gc(*runners, *classes):
        yield


def per_request_state(model_runner: Any) -> str | None:
    """What per-request state besides the KV cache the model keeps (a capture while serving would overwrite a live
    request's), in words; ``None``: none."""
    pool = getattr(model_runner, "req_to_token_pool", None)
    if getattr(pool, "mamba_pool", None) is not None:
        return "a mamba state pool (hybrid model)"
    return None
