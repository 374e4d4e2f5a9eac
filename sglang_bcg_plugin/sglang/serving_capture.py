"""A capture in a process that serves (a live switch, an incremental capture's step): the dummy batch SGLang
captures with writes its keys and values into the KV cache's padding slot, as at start-up, never into a live
request's.

SGLang's runners build their capture batch over their static input buffers (``capture_prepare``: the
``out_cache_loc`` slot of the process-wide input buffers, where the last replay left its batch's KV slots). At
start-up those buffers are zeros, and slot 0 is the slot SGLang reserves for the writes of padded tokens; in a
serving process they hold the last batch's slots, so the capture's warm-up and recorded forwards would write
dummy keys and values over a request still decoding (seen on an H100: the first token right, then eleven
zeros). :func:`dummy_writes_to_padding` zeroes the capture batch's ``out_cache_loc`` in place while it is open;
the graphs record the buffer's address, not its values, so what they replay is unchanged.

A model with per-request state besides the KV cache (a mamba pool) cannot be captured while it serves: the
capture clears the state of request slots that may be live (:func:`per_request_state`)."""

from __future__ import annotations

import contextlib
import functools
import importlib
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
def dummy_writes_to_padding(classes: list[type[Any]] | None = None) -> Iterator[None]:
    """While open, every ``capture_prepare`` of ``classes`` (default: :func:`runner_classes`) hands out its batch
    with ``out_cache_loc`` zeroed; restored after, also when the capture raises."""
    patched = []
    for cls in runner_classes() if classes is None else classes:
        original = cls.__dict__["capture_prepare"]

        @functools.wraps(original)
        def prepare(self: Any, *args: Any, __original: Any = original, **kwargs: Any) -> Any:
            prepared = __original(self, *args, **kwargs)
            to_padding(prepared)
            return prepared

        cls.capture_prepare = prepare
        patched.append((cls, original))
    try:
        yield
    finally:
        for cls, original in reversed(patched):
            cls.capture_prepare = original


def per_request_state(model_runner: Any) -> str | None:
    """What per-request state besides the KV cache the model keeps (a capture while serving would overwrite a live
    request's), in words; ``None``: none."""
    pool = getattr(model_runner, "req_to_token_pool", None)
    if getattr(pool, "mamba_pool", None) is not None:
        return "a mamba state pool (hybrid model)"
    return None
