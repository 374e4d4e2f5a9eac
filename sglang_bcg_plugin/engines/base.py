"""The engine seam: backends hand an engine a forward and a finalizer, get a graph back."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

Finalize = Callable[[Any], Any]
"""Runs inside the capture on the forward's output; returns the static output to hand out
(the output-sharing policy: adopt, copy into a shared view, or keep)."""


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


def run_warmups(request: CaptureRequest) -> None:
    """Eager warmup runs, each followed by ``post_warmup_hook``; then ``reserve`` on the last output."""
    out = None
    for _ in range(request.num_warmups):
        out = request.forward_fn()
        if request.post_warmup_hook is not None:
            request.post_warmup_hook()
    if request.reserve is not None and request.num_warmups > 0:
        request.reserve(out)
