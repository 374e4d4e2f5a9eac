"""The engine seam: backends hand an engine a forward and the output policy, get a graph back."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..output.policy import OutputPolicy
from ..output.trees import collect_tensors, storage_key


class CapturedGraph(Protocol):
    """One captured shape key: ``replay()`` refreshes ``output``; ``release()`` drops the graph."""

    output: Any
    num_segments: int

    def replay(self) -> Any: ...
    def release(self) -> None: ...


@dataclass(frozen=True, slots=True)
class CaptureRequest:
    """Everything an engine needs to capture one key (``static_inputs``: storages of
    ``capture_inputs``, never adopted)."""

    key: object
    forward_fn: Callable[[], Any]
    policy: OutputPolicy
    num_warmups: int
    post_warmup_hook: Callable[[], None] | None
    partition: int | None
    stream: Any = None
    static_inputs: frozenset[tuple[str, int]] = frozenset()

    def place(self, output: Any) -> Any:
        """Inside the capture: the key's output through the policy; returns the static output."""
        return self.policy.place(self.key, output, self.static_inputs)


class Engine(Protocol):
    """Captures graphs; one engine per backend. ``release()``: pools and streams, after every graph."""

    name: str

    def capture(self, request: CaptureRequest) -> CapturedGraph: ...

    def release(self) -> None:
        """Drop the engine's pools and streams (nothing by default)."""
        return None

    def bridge_bytes(self) -> dict[int | None, int]:
        """Bytes of bridge storage per partition (none by default)."""
        return {}


class Front(Protocol):
    """A segmented capture's front-end: where breaks are and what crosses them (Breakable, Piecewise);
    ``release()`` drops bridge storage, after every graph was released."""

    #: Fewest warmups a CUDA capture needs (Piecewise: 1, so ``torch.compile`` runs first).
    min_cuda_warmups: int = 0

    def recorder(self, key: object, segments: Any, partition: int | None,
                 static_inputs: frozenset[tuple[str, int]]) -> Any:
        """A :class:`~.recorder.Recorder` for one key over ``segments``."""

    def bridge_bytes(self) -> dict[int | None, int]:
        """Bytes of bridge storage per partition (none by default)."""
        return {}

    def release(self) -> None: ...


def run_warmups(request: CaptureRequest) -> Any:
    """Run the warmups (each followed by ``post_warmup_hook``), then ``policy.reserve`` from the last
    output, its storages marked foreign; returns that output: keep it alive until the capture ends,
    so no capture allocation can reuse its memory and pass for foreign."""
    out = None
    for _ in range(request.num_warmups):
        out = None  # the previous output is not kept: peak memory stays one output
        out = request.forward_fn()
        if request.post_warmup_hook is not None:
            request.post_warmup_hook()
    if request.num_warmups > 0:
        # strided tensors only: any other layout is refused by the output policy itself
        foreign = frozenset(storage_key(t) for t in collect_tensors(out) if t.layout == torch.strided)
        request.policy.reserve(request.key, out, foreign=foreign)
    return out
