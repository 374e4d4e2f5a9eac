"""Where a partition's shared buffer comes from: adopted inside the pool, or allocated first.

* ``adopt``: the partition's first (largest) capture keeps its own output as the buffer. No
  extra allocation and no copy for that key, but the buffer is a block of the graph pool,
  allocated at the end of the largest capture. On SGLang's segmented BCG engine keeping that
  block live costs one more output of pool fragmentation: smaller keys can no longer carve from
  it (H200: floor + 176 MiB vs floor + 90 MiB for ``prealloc``, ``docs/benchmarks.md``).
* ``prealloc``: the buffer is allocated from the **last warmup's output**, before the capture
  and outside the graph pool (what SGLang 0.5.23's built-in does with its
  ``_shared_output_buffer``, but sized by each leaf's own rows and dtype, for any output tree);
  every key, the first included, copies into it inside its graph. The pool then ends where
  the floor (every output released) ends, plus exactly one output outside it.

Each engine uses the strategy measured best for it (:data:`ENGINE_DEFAULTS`);
``SGLANG_BCG_SHARED_BUFFER=adopt|prealloc`` overrides it (for measurements). Our own engines
keep ``adopt`` until ``tests/gpu/test_sglang_gpu.py::test_our_engines_keep_the_measured_buffer_strategy``
has measured both on them: on our full engine adopting costs nothing (= the floor); on our
breakable engine it costs floor + 2 outputs, where ``prealloc`` is expected to cost one (the
SGLang engine's mechanism), but that was not measured yet.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ._constants import ENV_SHARED_BUFFER
from .errors import OutputStructureError
from .sharing import OutputSharer, SharedOutputFallbackWarning
from .trees import flatten, unflatten

BufferStrategy = Literal["adopt", "prealloc"]
ADOPT: BufferStrategy = "adopt"
PREALLOC: BufferStrategy = "prealloc"

#: (backend name, engine name) -> strategy; see docs/benchmarks.md for the measurements.
ENGINE_DEFAULTS: Mapping[tuple[str, str], BufferStrategy] = {
    ("breakable", "sglang-bcg"): PREALLOC,
    ("breakable", "cuda"): ADOPT,
    ("full", "cuda"): ADOPT,
}


def buffer_strategy(backend: str, engine: str, environ: Mapping[str, str] | None = None) -> BufferStrategy:
    """The strategy for ``backend`` on ``engine``: the env override, else the measured default.

    Unlisted combinations (the eager engine, whose "graph" owns nothing) adopt.

    :raises ValueError: ``SGLANG_BCG_SHARED_BUFFER`` is set to something else.
    """
    env = os.environ if environ is None else environ
    raw = env.get(ENV_SHARED_BUFFER)
    if raw is None or not raw.strip():
        return ENGINE_DEFAULTS.get((backend, engine), ADOPT)
    value = raw.strip().lower()
    if value == ADOPT:
        return ADOPT
    if value == PREALLOC:
        return PREALLOC
    msg = f"{ENV_SHARED_BUFFER}={raw!r} is not a buffer strategy; use 'adopt' or 'prealloc' (or unset it)"
    raise ValueError(msg)


def template_of(output: Any, capacity_rows: int | None = None) -> Any:
    """``output``'s tree with fresh, uninitialised, contiguous tensors of the same shapes.

    Leaves whose leading dim is the padded row dim (the largest leading dim of the output) get
    ``capacity_rows`` rows when that is larger (SGLang's ``cuda_graph_output_capacity_rows``).
    """
    node, leaves = flatten(output)
    padded = max((t.shape[0] for _, t in leaves if t.dim() > 0), default=None)
    fresh = []
    for _, t in leaves:
        shape = tuple(t.shape)
        if capacity_rows is not None and t.dim() > 0 and t.shape[0] == padded and capacity_rows > shape[0]:
            shape = (capacity_rows, *shape[1:])
        fresh.append(torch.empty(shape, dtype=t.dtype, device=t.device))
    return unflatten(node, fresh)


@dataclass(eq=False)
class Seed:
    """A partition created from a warmup output; ``rollback()`` removes it if its capture fails."""

    sharer: OutputSharer
    stream: int | None
    partition: object

    def rollback(self) -> None:
        if self.sharer.partitions.get(self.stream) is self.partition:
            del self.sharer.partitions[self.stream]


def seed_partition(sharer: OutputSharer, key: Hashable, warmup_output: Any, capacity_rows: int | None = None) -> Seed | None:
    """Give ``key``'s partition a buffer allocated now (call it outside any capture).

    ``None`` (nothing done) when sharing is off, the partition already has a buffer, or the
    output cannot be shared: the capture's own ``prepare`` then decides as usual (its one
    fallback warning, or ``OutputStructureError`` when strict).
    """
    if not sharer.enabled or warmup_output is None:
        return None
    stream = getattr(key, "stream_idx", None)
    if stream in sharer.partitions:
        return None
    try:
        template = template_of(warmup_output, capacity_rows)
    except TypeError:
        return None  # an unsupported tensor holder: the capture raises the real TypeError
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SharedOutputFallbackWarning)
        try:
            prepared = sharer.prepare(key, template)
        except OutputStructureError:
            return None
    if not prepared.shared:
        return None
    prepared.commit()
    return Seed(sharer, stream, sharer.partitions.get(stream))


class WarmupSeeder:
    """Wraps a capture request's forward and post-warmup hook: after the last warmup, the
    partition is seeded from that warmup's output (the engine is not capturing then)."""

    def __init__(
        self,
        sharer: OutputSharer,
        key: Hashable,
        forward_fn: Callable[[], Any],
        post_warmup_hook: Callable[[], None] | None,
        num_warmups: int,
    ) -> None:
        self._sharer = sharer
        self._key = key
        self._forward_fn = forward_fn
        self._post = post_warmup_hook
        self._num_warmups = num_warmups
        self._calls = 0
        self._hooks = 0
        self._last: Any = None
        self.seed: Seed | None = None

    def forward(self) -> Any:
        out = self._forward_fn()
        if self._calls < self._num_warmups:
            # Each warmup's output is dropped only when the next one exists (SGLang's loop does
            # the same): the buffer then lands in the block the previous output leaves free,
            # instead of splitting a larger cached block that empty_cache could not return.
            self._last = out
        self._calls += 1
        return out

    def hook(self) -> None:
        if self._post is not None:
            self._post()
        self._hooks += 1
        if self._hooks == self._num_warmups:
            out, self._last = self._last, None
            self.seed = seed_partition(self._sharer, self._key, out)

    def rollback(self) -> None:
        if self.seed is not None:
            self.seed.rollback()
