"""The output-sharing policy: one buffer per leaf path per stream partition.

Rules (docs/index.md, "Output sharing"):

* partition = ``shape_key.stream_idx``; keys of one partition may share, different partitions
  never do (their graphs may replay concurrently);
* a buffer is *storage, not rows* (:mod:`~sglang_bcg_plugin.storage`): one flat tensor per leaf
  path sized for the largest capture, and every key's leaf is a contiguous view with the leaf's
  own shape (the capture size may live on any dim; spec decode's ``4 * size`` rows come from the
  leaf, never from the key's size);
* where the buffer comes from: ``"adopt"`` — the first capture of a partition keeps its own output
  storage as the buffer (no extra allocation, no copy for that key); ``"reserve"`` — the buffer is
  allocated *before* the first capture from the last warmup's output (:meth:`OutputSharer.reserve`),
  outside the graph, and every key copies into it inside its graph. Which wins depends on the
  engine's allocator layout (docs/index.md);
* a key that does not fit (structure, type, dtype, device, changed non-tensor value, or more
  elements than the buffer holds) keeps its own output — one warning naming key, leaf path and
  reason — or, in strict mode, raises :class:`OutputStructureError`;
* a leaf that requires grad while autograd is on raises ``ValueError`` (a shared buffer holds
  values, not autograd history: capture under ``torch.no_grad()``).

``prepare`` runs inside the capture (its copies are recorded into the graph); the partition is
only created by ``Prepared.commit`` once the capture succeeded, so a failed capture leaves the
policy as it was.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Literal

import torch

from .errors import OutputStructureError, warn_user
from .scan import cut
from .storage import flat_of, view_of
from .trees import Node, diff, flatten, storage_key, unflatten

BufferSource = Literal["adopt", "reserve"]


class SharedOutputFallbackWarning(UserWarning):
    """A shape key keeps its own output because it does not fit its partition's buffer."""


@dataclass(eq=False)
class Partition:
    """Shared buffers of one stream partition: one flat tensor per leaf path."""

    stream_idx: int | None
    owner: Hashable | None
    spec: Node
    paths: tuple[str, ...]
    buffers: tuple[torch.Tensor, ...]


@dataclass(eq=False)
class Prepared:
    """Result of ``OutputSharer.prepare`` for one key."""

    output: object
    shared: bool
    fallback: str | None = None
    logical_bytes: int = 0
    _commit: Callable[[], None] | None = field(default=None, repr=False)

    def commit(self) -> None:
        """Make the key's effect on the policy permanent (call after a successful capture)."""
        if self._commit is not None:
            self._commit()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _leaf_misfit(leaf: torch.Tensor, buf: torch.Tensor) -> str | None:
    if leaf.dtype != buf.dtype:
        return f"dtype changed: buffer {buf.dtype}, output {leaf.dtype}"
    if leaf.device != buf.device:
        return f"device changed: buffer {buf.device}, output {leaf.device}"
    if buf.is_inference() and not torch.is_inference_mode_enabled():
        return (
            "the buffer was made under torch.inference_mode() and this capture runs outside it "
            "(only inference mode may write an inference tensor); capture every key of a "
            "partition in one mode"
        )
    if leaf.numel() > buf.numel():
        return (
            f"{_nbytes(leaf)} bytes (shape {tuple(leaf.shape)}) do not fit the buffer's "
            f"{_nbytes(buf)} bytes (capture was not largest-first)"
        )
    return None


def _check_no_grad(key: Hashable, leaves: list[tuple[str, torch.Tensor]]) -> None:
    """A shared buffer cannot carry autograd history: refuse a leaf that requires grad."""
    if not torch.is_grad_enabled():
        return
    for path, leaf in leaves:
        if leaf.requires_grad:
            msg = (
                f"output of {key!r} at leaf {path} requires grad (the forward ran with autograd on, "
                "over parameters that require grad); shared output buffers hold values, not autograd "
                "history: capture under torch.no_grad() or torch.inference_mode() (as SGLang does), "
                f"or return {path}.detach()"
            )
            raise ValueError(msg)


class OutputSharer:
    """Applies the sharing policy for one capture session of one backend."""

    def __init__(self, *, enabled: bool, strict: bool, source: BufferSource = "adopt") -> None:
        self.enabled = enabled
        self.strict = strict
        self.source = source
        self.partitions: dict[int | None, Partition] = {}
        self._reserved: dict[int | None, Partition] = {}

    def reserve(self, key: Hashable, output: object, capacity_rows: int | None = None) -> None:
        """Allocate ``key``'s partition's buffers now (outside any capture) from ``output``.

        Called with the last warmup's output before the first capture of a partition when the
        source is ``"reserve"``; a no-op once the partition has buffers or when sharing is off.
        A reservation is only claimed by a capture whose output fits it (``prepare``); one left
        by a failed capture is replaced by the next key's.

        :param capacity_rows: grow leaves whose leading dim is the output's largest (the padded
            row dim) to this many rows (SGLang's ``cuda_graph_output_capacity_rows``).
        """
        if not self.enabled or self.source != "reserve":
            return
        stream = getattr(key, "stream_idx", None)
        if stream in self.partitions:
            return
        node, leaves = flatten(output)
        padded = max((t.shape[0] for _, t in leaves if t.dim() > 0), default=None)
        buffers = []
        for path, t in leaves:
            numel = t.numel()
            if capacity_rows is not None and t.dim() > 0 and t.shape[0] == padded and capacity_rows > padded:
                numel = math.prod(t.shape[1:]) * capacity_rows
            buffers.append(torch.empty(max(numel, 1), dtype=t.dtype, device=t.device))
        self._reserved[stream] = Partition(stream, None, node, tuple(p for p, _ in leaves), tuple(buffers))

    def prepare(
        self,
        key: Hashable,
        output: object,
        protected: frozenset[tuple[str, int]] = frozenset(),
        foreign: frozenset[tuple[str, int]] | None = frozenset(),
    ) -> Prepared:
        """Decide how ``key``'s output is held; runs inside the capture.

        :param protected: storages the output must not adopt as a shared buffer (static
            inputs): smaller keys would overwrite them.
        :param foreign: storages the forward returned but did not allocate (they outlived the
            last warmup: a static input, a weight, a tensor the model keeps); never adopted
            either. ``None``: unknown (no warmup ran), so nothing is adopted.
        """
        node, leaves = flatten(output)
        logical = sum(_nbytes(t) for _, t in leaves)
        if not self.enabled:
            return Prepared(output, shared=False, logical_bytes=logical)
        _check_no_grad(key, leaves)
        stream = getattr(key, "stream_idx", None)
        part = self.partitions.get(stream)
        if part is None:
            reserved = self._reserved.get(stream)
            if reserved is not None and self._misfit(reserved, node, leaves) is None:
                return self._copy_into(reserved, node, leaves, logical, self._claim(stream, key, reserved))
            return self._adopt(key, stream, node, leaves, logical, protected, foreign)
        found = self._misfit(part, node, leaves)
        if found is not None:
            return self._fallback(key, output, logical, *found)
        return self._copy_into(part, node, leaves, logical, None)

    @staticmethod
    def _misfit(part: Partition, node: Node, leaves: list[tuple[str, torch.Tensor]]) -> tuple[str, str] | None:
        found = diff(part.spec, node)
        if found is None:
            for (path, leaf), buf in zip(leaves, part.buffers, strict=True):
                reason = _leaf_misfit(leaf, buf)
                if reason is not None:
                    return (path, reason)
        return found

    def _claim(self, stream: int | None, key: Hashable, reserved: Partition) -> Callable[[], None]:
        def commit() -> None:
            reserved.owner = key
            self.partitions[stream] = reserved
            self._reserved.pop(stream, None)

        return commit

    @staticmethod
    def _copy_into(
        part: Partition,
        node: Node,
        leaves: list[tuple[str, torch.Tensor]],
        logical: int,
        commit: Callable[[], None] | None,
    ) -> Prepared:
        views = []
        for (_, leaf), buf in zip(leaves, part.buffers, strict=True):
            view = view_of(buf, leaf.shape)
            view.copy_(leaf)
            views.append(view)
        return Prepared(unflatten(node, views), shared=True, logical_bytes=logical, _commit=commit)

    def _adopt(
        self,
        key: Hashable,
        stream: int | None,
        node: Node,
        leaves: list[tuple[str, torch.Tensor]],
        logical: int,
        protected: frozenset[tuple[str, int]],
        foreign: frozenset[tuple[str, int]] | None,
    ) -> Prepared:
        # A leaf that aliases a static input, memory the forward did not allocate (foreign) or
        # another leaf's storage at another path would be overwritten by smaller keys' copies,
        # and a non-contiguous leaf has no flat view: those get a private buffer (a contiguous
        # copy) instead.
        seen: set[tuple[str, int]] = set()
        buffers, outs = [], []
        for path, leaf in leaves:
            sk = storage_key(leaf)
            owned = foreign is not None and sk not in foreign and sk not in protected
            flat = flat_of(leaf) if owned and sk not in seen else None
            seen.add(sk)
            if flat is None:
                flat = torch.empty(max(leaf.numel(), 1), dtype=leaf.dtype, device=leaf.device)
                view = view_of(flat, leaf.shape)
                view.copy_(leaf)
                outs.append(view)
            else:
                outs.append(leaf)
            buffers.append(flat)
        part = Partition(stream, key, node, tuple(p for p, _ in leaves), tuple(buffers))

        def commit() -> None:
            self.partitions[stream] = part
            self._reserved.pop(stream, None)

        return Prepared(unflatten(node, outs), shared=True, logical_bytes=logical, _commit=commit)

    def _fallback(self, key: Hashable, output: object, logical: int, path: str, reason: str) -> Prepared:
        if self.strict:
            raise OutputStructureError(key, path, reason)
        msg = f"{key!r} keeps its own output (no sharing): leaf {cut(path)}: {reason}"
        warn_user(msg, SharedOutputFallbackWarning)
        return Prepared(output, shared=False, fallback=f"{path}: {reason}", logical_bytes=logical)
