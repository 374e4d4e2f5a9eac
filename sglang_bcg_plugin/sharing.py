"""The output-sharing policy: one buffer per leaf path per stream partition.

Rules (docs/index.md, "Output sharing"):

* partition = ``shape_key.stream_idx``; keys of one partition may share, different partitions
  never do (their graphs may replay concurrently);
* the first capture of a partition *adopts* its own output storage as the buffer (no extra
  allocation, no copy); later keys copy each leaf into ``buffer[:rows]`` inside their graph and
  hand out that view;
* rows come from the leaf (``shape[0]``), never from the key's size;
* a key that does not fit keeps its own output (one warning naming key, leaf path and reason)
  or, in strict mode, raises :class:`OutputStructureError`.

``prepare`` runs inside the capture (its copies are recorded into the graph); the partition is
only created by ``Prepared.commit`` once the capture succeeded, so a failed capture leaves the
policy as it was.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch

from .errors import OutputStructureError
from .trees import Node, diff, flatten, storage_key, unflatten


class SharedOutputFallbackWarning(UserWarning):
    """A shape key keeps its own output because it does not fit its partition's buffer."""


@dataclass(eq=False)
class Partition:
    """Shared buffers of one stream partition."""

    stream_idx: int | None
    owner: Hashable
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


def _leaf_misfit(leaf: torch.Tensor, buf: torch.Tensor | None) -> str | None:
    if leaf.dim() == 0:
        return "0-dim leaf has no rows to share"
    if buf is None:
        return None
    if leaf.dtype != buf.dtype:
        return f"dtype changed: buffer {buf.dtype}, output {leaf.dtype}"
    if leaf.device != buf.device:
        return f"device changed: buffer {buf.device}, output {leaf.device}"
    if leaf.shape[1:] != buf.shape[1:]:
        return (
            f"trailing shape changed: buffer {tuple(buf.shape[1:])}, "
            f"output {tuple(leaf.shape[1:])}"
        )
    if leaf.shape[0] > buf.shape[0]:
        return (
            f"{leaf.shape[0]} rows do not fit the buffer's {buf.shape[0]} rows "
            "(capture was not largest-first)"
        )
    return None


class OutputSharer:
    """Applies the sharing policy for one capture session of one backend."""

    def __init__(self, *, enabled: bool, strict: bool) -> None:
        self.enabled = enabled
        self.strict = strict
        self.partitions: dict[int | None, Partition] = {}

    def prepare(
        self,
        key: Hashable,
        output: object,
        protected: frozenset[tuple[str, int]] = frozenset(),
    ) -> Prepared:
        """Decide how ``key``'s output is held; runs inside the capture.

        :param protected: storages the output must not adopt as a shared buffer (static
            inputs): smaller keys would overwrite them.
        """
        node, leaves = flatten(output)
        logical = sum(t.numel() * t.element_size() for _, t in leaves)
        if not self.enabled:
            return Prepared(output, shared=False, logical_bytes=logical)
        stream = getattr(key, "stream_idx", None)
        part = self.partitions.get(stream)
        if part is None:
            return self._adopt(key, stream, node, leaves, logical, protected)
        found = diff(part.spec, node)
        if found is None:
            for (path, leaf), buf in zip(leaves, part.buffers, strict=True):
                reason = _leaf_misfit(leaf, buf)
                if reason is not None:
                    found = (path, reason)
                    break
        if found is not None:
            return self._fallback(key, output, logical, *found)
        views = []
        for (_, leaf), buf in zip(leaves, part.buffers, strict=True):
            view = buf[: leaf.shape[0]]
            view.copy_(leaf)
            views.append(view)
        return Prepared(unflatten(node, views), shared=True, logical_bytes=logical)

    def _adopt(
        self,
        key: Hashable,
        stream: int | None,
        node: Node,
        leaves: list[tuple[str, torch.Tensor]],
        logical: int,
        protected: frozenset[tuple[str, int]],
    ) -> Prepared:
        for path, leaf in leaves:
            reason = _leaf_misfit(leaf, None)
            if reason is not None:
                return self._fallback(key, unflatten(node, [t for _, t in leaves]), logical, path, reason)
        # A leaf that aliases a static input (or another leaf's storage at another path) would
        # be overwritten by smaller keys' copies: give it a private buffer instead.
        seen: set[tuple[str, int]] = set()
        buffers = []
        for _, leaf in leaves:
            sk = storage_key(leaf)
            buffers.append(leaf.clone() if sk in protected or sk in seen else leaf)
            seen.add(sk)
        part = Partition(stream, key, node, tuple(p for p, _ in leaves), tuple(buffers))

        def commit() -> None:
            self.partitions[stream] = part

        return Prepared(unflatten(node, buffers), shared=True, logical_bytes=logical, _commit=commit)

    def _fallback(self, key: Hashable, output: object, logical: int, path: str, reason: str) -> Prepared:
        if self.strict:
            raise OutputStructureError(key, path, reason)
        msg = f"{key!r} keeps its own output (no sharing): leaf {path}: {reason}"
        warnings.warn(msg, SharedOutputFallbackWarning, stacklevel=4)
        return Prepared(output, shared=False, fallback=f"{path}: {reason}", logical_bytes=logical)
