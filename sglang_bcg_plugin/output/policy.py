"""The output policy: one buffer per leaf path per stream partition, released outputs (docs/index.md#output-sharing). A
key goes ``reserve`` (last warmup) → ``place`` (inside the capture) → ``commit``."""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..errors import CaptureStateError, OutputStructureError, warn_user
from .guard import GUARD, StaleOutputGuard
from .mode import OFF, ON, RELEASED
from .released import release_output
from .scan import cut
from .trees import Leaves, Node, Storages, diff, flatten, storage_key, unflatten

if TYPE_CHECKING:
    from .plan import BufferSource, SessionPlan


class SharedOutputFallbackWarning(UserWarning):
    """A shape key keeps its own output because it does not fit its partition's buffer."""


@dataclass(eq=False)
class _Partition:
    """Shared buffers of one stream partition: one flat tensor per leaf path."""

    spec: Node
    buffers: tuple[torch.Tensor, ...]


@dataclass(eq=False)
class Placed:
    """How one key's output is held, from ``place`` until ``commit`` hands it back."""

    output: object
    shared: bool
    fallback: str | None = None
    logical_bytes: int = 0
    released: bool = False
    #: the partition this key creates (its first capture), installed at commit
    creates: _Partition | None = field(default=None, repr=False)


def _view_of(flat: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The contiguous ``shape``-shaped view at the start of the flat buffer ``flat`` (storage, not rows)."""
    return flat[: math.prod(shape)].view(shape)


def _leaf_misfit(leaf: torch.Tensor, buf: torch.Tensor) -> str | None:
    if leaf.dtype != buf.dtype:
        return f"dtype changed: buffer {buf.dtype}, output {leaf.dtype}"
    if leaf.device != buf.device:
        return f"device changed: buffer {buf.device}, output {leaf.device}"
    if buf.is_inference() and not torch.is_inference_mode_enabled():
        return ("the buffer was made under torch.inference_mode() and this capture runs outside it (only inference "
                "mode may write an inference tensor); capture every key of a partition in one mode")
    if leaf.numel() > buf.numel():
        return (f"{leaf.nbytes} bytes (shape {tuple(leaf.shape)}) do not fit the buffer's "
                f"{buf.nbytes} bytes (capture was not largest-first)")
    return None


class OutputPolicy:
    """One backend's output policy; a session starts with :meth:`open`."""

    def __init__(self) -> None:
        self.enabled = self.strict = self.release = self.keep_first = False
        self.source: BufferSource = "adopt"
        self.partitions: dict[int | None, _Partition] = {}
        self._reserved: dict[int | None, _Partition] = {}
        self._foreign: dict[Hashable, Storages] = {}
        self._placed: dict[Hashable, Placed] = {}
        self.guard: StaleOutputGuard | None = None
        #: the last session's mode, partitions, reserved buffers and whether its first key is still to come, for a
        #: session that resumes it
        self._kept: tuple[str, dict[int | None, _Partition], dict[int | None, _Partition], bool] | None = None

    def open(self, plan: SessionPlan, resume: bool = False) -> None:
        """A session with ``plan``: fresh partitions, or with ``resume`` the last session's where it had the same
        mode (its later sizes share its buffers; the largest was captured then, or, where it captured nothing, is
        the first this one captures); the guard read now serves every replay."""
        self.enabled, self.strict, self.source = plan.mode == ON, plan.strict, plan.buffer_source
        self.release, self.keep_first = plan.mode == RELEASED, plan.released_keeps_largest
        kept, self._kept = self._kept, None
        if resume and kept is not None and kept[0] == plan.mode:
            _, self.partitions, self._reserved, self.keep_first = kept
        if plan.guard and not plan.guard_armed and self.guard is None:
            msg = ("stale_output_guard is on but this torch build cannot poison storages (needs "
                   "torch._C._set_storage_access_error_msg, present in CUDA builds); the guard does nothing")
            warn_user(msg, RuntimeWarning)
        self.guard = GUARD if plan.guard_armed else None

    def close(self) -> None:
        """The session ended: its partitions kept only for a session that resumes it (the graphs hold their
        outputs); pending keys dropped."""
        mode = ON if self.enabled else RELEASED if self.release else OFF
        self._kept = (mode, self.partitions, self._reserved, self.keep_first)
        self.partitions, self._reserved, self._foreign, self._placed = {}, {}, {}, {}

    def forget(self) -> None:
        """Drop what a resumed session would have shared (the graphs are gone)."""
        self._kept = None

    def reserve(self, key: Hashable, output: object, capacity_rows: int | None = None,
                foreign: Storages = frozenset()) -> None:
        """From the last warmup's ``output``: note ``foreign`` storages (never adopted; a key never seen
        here adopts nothing); with the ``"reserve"`` source and no buffer yet, allocate the partition's
        buffers (the padded row dim grown to ``capacity_rows``)."""
        self._foreign[key] = foreign
        stream = getattr(key, "stream_idx", None)
        if not self.enabled or self.source != "reserve" or output is None or stream in self.partitions:
            return
        try:
            node, leaves = flatten(output)
        except TypeError:
            return  # an unsupported tensor holder: place() raises the real TypeError
        padded = max((t.shape[0] for _, t in leaves if t.dim() > 0), default=None)
        buffers = []
        for _, t in leaves:
            numel = t.numel()
            if capacity_rows is not None and t.dim() > 0 and t.shape[0] == padded and capacity_rows > padded:
                numel = math.prod(t.shape[1:]) * capacity_rows
            buffers.append(torch.empty(max(numel, 1), dtype=t.dtype, device=t.device))
        self._reserved[stream] = _Partition(node, tuple(buffers))

    def place(self, key: Hashable, output: object, protected: Storages = frozenset()) -> Any:
        """Inside the capture: hold ``key``'s output (in-graph copy, adopt or own; never adopting the
        ``protected`` storages); returns the graph's static output.

        :raises OutputStructureError: a misfit in strict mode. :raises ValueError: a leaf requires
            grad with sharing on. :raises TypeError: an output the tree walk cannot track."""
        placed = self._place(key, output, protected, self._foreign.pop(key, None))
        self._placed = {key: placed}  # one key in flight (captures do not nest): a failed one's is dropped
        return placed.output

    def discard(self) -> None:
        """A capture failed: drop its placed output (nothing was committed)."""
        self._placed = {}

    def _place(self, key: Hashable, output: object, protected: Storages, foreign: Storages | None) -> Placed:
        node, leaves = flatten(output)
        logical = sum(t.nbytes for _, t in leaves)
        if not self.enabled:
            return Placed(output, shared=False, logical_bytes=logical)
        grads = [path for path, leaf in leaves if leaf.requires_grad and torch.is_grad_enabled()]
        if grads:
            msg = (f"output of {key!r} at leaf {grads[0]} requires grad (the forward ran with autograd on, over "
                   "parameters that require grad); shared output buffers hold values, not autograd history: capture "
                   f"under torch.no_grad() or torch.inference_mode() (as SGLang does), or return {grads[0]}.detach()")
            raise ValueError(msg)
        stream = getattr(key, "stream_idx", None)
        part = self.partitions.get(stream)
        if part is None:
            reserved = self._reserved.get(stream)
            if reserved is not None and self._misfit(reserved, node, leaves) is None:
                return self._copy_into(reserved, node, leaves, logical, creates=reserved)
            return self._adopt(node, leaves, logical, protected, foreign)
        found = self._misfit(part, node, leaves)
        if found is None:
            return self._copy_into(part, node, leaves, logical, creates=None)
        path, reason = found
        if self.strict:
            raise OutputStructureError(key, path, reason)
        msg = f"{key!r} keeps its own output (no sharing): leaf {cut(path)}: {reason}"
        warn_user(msg, SharedOutputFallbackWarning)
        return Placed(output, shared=False, fallback=f"{path}: {reason}", logical_bytes=logical)

    def commit(self, key: Hashable, *, can_release: bool = True) -> Placed:
        """After a successful capture: make ``key``'s placement permanent and return it (mode
        ``released``, ``can_release``: a non-owning alias, unless the plan keeps the first capture's).

        :raises CaptureStateError: ``key``'s output was never placed."""
        placed = self._placed.pop(key, None)
        if placed is None:
            msg = f"capture of {key!r} ended without placing its output (the engine never called place)"
            raise CaptureStateError(msg)
        if placed.creates is not None:
            stream = getattr(key, "stream_idx", None)
            self.partitions[stream] = placed.creates
            self._reserved.pop(stream, None)
            placed.creates = None
        placed.released = self.release and can_release and not self.keep_first
        self.keep_first = False
        if placed.released:
            placed.output = release_output(placed.output)
        return placed

    @staticmethod
    def _misfit(part: _Partition, node: Node, leaves: Leaves) -> tuple[str, str] | None:
        found = diff(part.spec, node)
        if found is None:
            for (path, leaf), buf in zip(leaves, part.buffers, strict=True):
                reason = _leaf_misfit(leaf, buf)
                if reason is not None:
                    return (path, reason)
        return found

    @staticmethod
    def _copy_into(part: _Partition, node: Node, leaves: Leaves, logical: int, creates: _Partition | None) -> Placed:
        views = [_view_of(buf, leaf.shape).copy_(leaf) for (_, leaf), buf in zip(leaves, part.buffers, strict=True)]
        return Placed(unflatten(node, views), shared=True, logical_bytes=logical, creates=creates)

    @staticmethod
    def _adopt(node: Node, leaves: Leaves, logical: int, protected: Storages, foreign: Storages | None) -> Placed:
        # a leaf aliasing a static input, foreign memory or another leaf, or not contiguous,
        # gets a private buffer (rule 5)
        seen: set[tuple[str, int]] = set()
        buffers, outs = [], []
        for _, leaf in leaves:
            sk = storage_key(leaf)
            owned = foreign is not None and sk not in foreign and sk not in protected
            flat = leaf.view(-1) if owned and sk not in seen and leaf.is_contiguous() else None
            seen.add(sk)
            if flat is None:
                flat = torch.empty(max(leaf.numel(), 1), dtype=leaf.dtype, device=leaf.device)
                outs.append(_view_of(flat, leaf.shape).copy_(leaf))
            else:
                outs.append(leaf)
            buffers.append(flat)
        part = _Partition(node, tuple(buffers))
        return Placed(unflatten(node, outs), shared=True, logical_bytes=logical, creates=part)
