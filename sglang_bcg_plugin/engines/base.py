"""The engine seam: backends hand an engine a forward and a finalizer, get a graph back."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..trees import collect_tensors, storage_key

Finalize = Callable[..., Any]
"""``finalize(output, foreign=...)`` runs inside the capture on the forward's output; returns the
static output to hand out (the output-sharing policy: adopt, copy into a shared view, or keep).
``foreign``: storages the forward returns but did not allocate (see :func:`run_warmups`)."""


class CapturedGraph(Protocol):
    """One captured shape key."""

    output: Any
    num_segments: int

    def replay(self) -> Any:
        """Run the graph; the static output now holds this run's values."""

    def release(self) -> None:
        """Drop graph resources (after this, ``replay`` must not be called)."""


@dataclass(frozen=True, slots=True)
class CaptureRequest:
    """Everything an engine needs to capture one key.

    :param reserve: called with the last warmup's output, outside any capture, before the
        capture begins (the output policy allocates a reserved shared buffer there).
    :param static_inputs: storages of the static inputs (``capture_inputs``): the output policy
        never adopts them, and the piecewise recorder counts them as produced storage.
    """

    key: object
    forward_fn: Callable[[], Any]
    finalize: Finalize
    num_warmups: int
    post_warmup_hook: Callable[[], None] | None
    partition: int | None
    stream: Any = None
    reserve: Callable[[Any], None] | None = None
    static_inputs: frozenset[tuple[str, int]] = frozenset()


class Engine(Protocol):
    """Captures graphs; one engine per backend."""

    name: str

    def capture(self, request: CaptureRequest) -> CapturedGraph: ...

    def release(self) -> None:
        """Release pools and streams (after every graph was released)."""

    def bridge_bytes(self) -> dict[int | None, int]:
        """Bytes of bridge storage per partition (0 for engines without breaks)."""


class Warmed:
    """What the warmups leave for the capture: the last warmup's output, kept alive until the
    capture's ``finalize`` ran, so no storage the capture allocates can reuse its memory.

    A storage that the capture's output shares with the last warmup's output was not allocated
    by the forward: it is memory the forward *returns* (a view of a static input, a weight, a
    cache, a tensor the model keeps). Such storage must never become a shared output buffer —
    smaller keys would write into it (docs/index.md, "Output sharing", rule 5).
    """

    def __init__(self, output: Any, ran: bool) -> None:
        self._output = output
        self._ran = ran

    @property
    def foreign(self) -> frozenset[tuple[str, int]] | None:
        """Storages of the last warmup output; ``None`` when no warmup ran (nothing is known)."""
        if not self._ran:
            return None
        # strided tensors only: any other layout is refused by the output policy itself
        return frozenset(storage_key(t) for t in collect_tensors(self._output) if t.layout == torch.strided)

    def finalize(self, request: CaptureRequest) -> Finalize:
        """``request.finalize`` told which storages are foreign."""
        foreign = self.foreign

        def finalize(output: Any) -> Any:
            return request.finalize(output, foreign=foreign)

        return finalize


class Front(Protocol):
    """A segmented capture's front-end: where breaks are and what crosses them.

    Two siblings: the Breakable front (``engines/breakable.py``: ``@graph_break`` functions) and
    the Piecewise front (``backends/piecewise/record.py``: FX pieces split at splitting ops). The
    one segmented engine (:mod:`.segmented`) runs either over CUDA-graph or eager segments.
    """

    #: Fewest warmups a CUDA capture needs (Piecewise: 1, so ``torch.compile`` runs first).
    min_cuda_warmups: int

    def recorder(self, key: object, segments: Any, partition: int | None, static_inputs: frozenset[tuple[str, int]]) -> Any:
        """A :class:`~.recorder.Recorder` for one key over ``segments``."""

    def bridge_bytes(self) -> dict[int | None, int]:
        """Bytes of bridge storage per partition."""

    def release(self) -> None:
        """Drop bridge storage (after every graph was released)."""


def run_warmups(request: CaptureRequest) -> Warmed:
    """Eager warmup runs, each followed by ``post_warmup_hook``; then ``reserve`` on the last
    output. Keep the result alive until the capture finished (see :class:`Warmed`)."""
    out = None
    for _ in range(request.num_warmups):
        out = None  # the previous output is not kept: peak memory stays one output
        out = request.forward_fn()
        if request.post_warmup_hook is not None:
            request.post_warmup_hook()
    if request.reserve is not None and request.num_warmups > 0:
        request.reserve(out)
    return Warmed(out, request.num_warmups > 0)
