"""The engine seam: backends hand an engine a forward and a finalizer, get a graph back."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

Finalize = Callable[[Any], Any]
"""Runs inside the capture on the forward's output; returns the static output to hand out
(the output-sharing policy: adopt, copy into a shared slice, or keep)."""


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
    """Everything an engine needs to capture one key."""

    key: object
    forward_fn: Callable[[], Any]
    finalize: Finalize
    num_warmups: int
    post_warmup_hook: Callable[[], None] | None
    partition: int | None
    stream: Any = None


class Engine(Protocol):
    """Captures graphs; one engine per backend."""

    name: str

    def capture(self, request: CaptureRequest) -> CapturedGraph: ...

    def release(self) -> None:
        """Release pools and streams (after every graph was released)."""


def run_warmups(request: CaptureRequest) -> None:
    """Eager warmup runs, each followed by ``post_warmup_hook``."""
    for _ in range(request.num_warmups):
        request.forward_fn()
        if request.post_warmup_hook is not None:
            request.post_warmup_hook()
