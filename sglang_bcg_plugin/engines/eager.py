"""Engines without CUDA graphs (CPU, ``engine="eager"``): Full's (replay re-runs the forward and writes
into the captured output) and the segmented engine over eager segments (:mod:`.tape`), for either front."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..output.trees import diff, flatten, skeleton
from .base import CaptureRequest, Engine, Front, run_warmups
from .recorder import SegmentedGraph, record, refresh
from .tape import EagerSegments


class EagerGraph:
    """A "graph" that re-runs the forward and writes into the captured output storage."""

    num_segments = 1

    def __init__(self, key: object, forward_fn: Callable[[], Any], output: Any, returned: Any = None) -> None:
        """``output``: the static output (the policy's placement); ``returned``: what the forward returned
        at capture (default ``output``), the structure every replay's forward must return again."""
        self.key, self.output = key, output
        self._forward_fn: Callable[[], Any] | None = forward_fn
        self._static = [t for _, t in flatten(output)[1]]
        # the forward's own output, not the placement: a shared leaf is a plain view where the forward
        # returned a parameter or a tensor subclass, a repeated leaf a copy of its own
        self._spec = skeleton(flatten(output if returned is None else returned)[0])
        # the forward re-runs in the capture's autograd mode (docs/reliability.md)
        self._inference = torch.is_inference_mode_enabled()

    def replay(self) -> Any:
        if self._forward_fn is None:
            raise RuntimeError(f"graph of {self.key!r} was released; capture it again")
        with torch.inference_mode(self._inference), torch.no_grad():
            spec, leaves = flatten(self._forward_fn())
            found = diff(self._spec, spec)
            if found is not None:
                raise RuntimeError(f"forward of {self.key!r} returned another structure at replay than at capture "
                                   f"({found[0]}: {found[1]}); a CUDA graph would replay the captured one")
            for static, (path, new) in zip(self._static, leaves, strict=True):
                refresh(static, new, f"forward of {self.key!r} at {path}")
        return self.output

    def release(self) -> None:
        self._forward_fn = None


class EagerEngine(Engine):
    """Full's engine for CPU machines and debugging."""

    name = "eager"

    def capture(self, request: CaptureRequest) -> EagerGraph:
        warm = run_warmups(request)  # noqa: F841 - kept alive until the output is placed (foreign storages)
        returned = request.forward_fn()
        return EagerGraph(request.key, request.forward_fn, request.place(returned), returned)


class EagerSegmentEngine(Engine):
    """Segments of ops recorded on the eager tape; the front's breaks run eagerly between them."""

    name = "eager"

    def __init__(self, front: Front) -> None:
        self.front = front

    def capture(self, request: CaptureRequest) -> SegmentedGraph:
        warm = run_warmups(request)  # noqa: F841 - kept alive until the output is placed (foreign storages)
        recorder = self.front.recorder(request.key, EagerSegments(request.key), request.partition,
                                       request.static_inputs)
        return record(recorder, request.forward_fn, request.place)

    def release(self) -> None:
        self.front.release()

    def bridge_bytes(self) -> dict[int | None, int]:
        return self.front.bridge_bytes()
