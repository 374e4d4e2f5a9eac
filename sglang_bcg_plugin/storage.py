"""Where shared bytes live: flat, named storage per partition, viewed by every use in its own shape.

Output sharing (:mod:`~sglang_bcg_plugin.sharing`) and the bridges of segmented engines (tensors
crossing a break or a splitting op) both keep memory that many shape keys reuse. One rule serves
both — *storage, not rows*:

* a **slot** is one flat (1-D, contiguous) tensor, named (a leaf path, a bridge argument, a
  register) and typed (dtype, device);
* a **use** is the contiguous view ``slot[:numel].view(shape)`` with the use's own shape, so the
  capture size may live on any dim and several dims may vary: tokens-first ``[tokens, hidden]``,
  batch-first ``[1, seq, hidden]`` and attention's ``[1, heads, seq, head_dim]`` all share;
* a slot is sized for the largest use; a use that needs more bytes than every slot of its name
  holds gets a new slot (bridges: older graphs keep the slot they were captured with) or is
  refused by the caller (outputs: per-key fallback, capture was not largest-first).

Partition = ``stream_idx``: graphs of one partition never replay concurrently, so they may share
slots; each partition has its own :class:`SlotStore` and nothing is shared across partitions.
"""

from __future__ import annotations

import torch

SlotId = tuple[str, torch.dtype, str]


def slot_id(name: str, like: torch.Tensor) -> SlotId:
    """The identity of ``name``'s slots for tensors like ``like``: name, dtype and device."""
    return (name, like.dtype, str(like.device))


def view_of(flat: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """The contiguous ``shape``-shaped view at the start of the flat slot ``flat``."""
    numel = 1
    for d in shape:
        numel *= d
    return flat[:numel].view(shape)


def flat_of(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` as a flat view of its own elements, or ``None`` when it is not contiguous."""
    if not t.is_contiguous():
        return None
    return t.view(-1)


class SlotStore:
    """The slots of one partition, by (name, dtype, device).

    Slots are held strongly for the store's lifetime (graphs captured against a slot keep its
    address: a weak reference would let a later capture re-carve it, SGLang #37606).
    """

    def __init__(self) -> None:
        self._slots: dict[SlotId, list[torch.Tensor]] = {}

    def find(self, name: str, like: torch.Tensor) -> torch.Tensor | None:
        """The first slot of ``name`` that holds ``like``'s elements, else ``None``."""
        need = like.numel()
        for flat in self._slots.get(slot_id(name, like), ()):
            if flat.numel() >= need:
                return flat
        return None

    def add(self, name: str, flat: torch.Tensor) -> torch.Tensor:
        """Keep the flat tensor ``flat`` as a slot of ``name``; returns it."""
        self._slots.setdefault(slot_id(name, flat), []).append(flat)
        return flat

    def slot(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """A flat slot of ``name`` that holds ``like``'s elements; allocates one if none fits.

        Inside a running capture the allocation comes from the graph pool, like any tensor the
        captured work allocates.
        """
        flat = self.find(name, like)
        if flat is None:
            flat = self.add(name, torch.empty(max(like.numel(), 1), dtype=like.dtype, device=like.device))
        return flat

    def view(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """A contiguous ``like``-shaped view of a slot of ``name`` (see :meth:`slot`)."""
        return view_of(self.slot(name, like), like.shape)

    def nbytes(self) -> int:
        """Bytes held by every slot of the store."""
        return sum(f.numel() * f.element_size() for flats in self._slots.values() for f in flats)

    def clear(self) -> None:
        self._slots.clear()


class PartitionStores:
    """One :class:`SlotStore` per partition (``stream_idx``), made on first use."""

    def __init__(self) -> None:
        self._stores: dict[int | None, SlotStore] = {}

    def __call__(self, partition: int | None) -> SlotStore:
        """The store of ``partition``."""
        store = self._stores.get(partition)
        if store is None:
            store = self._stores[partition] = SlotStore()
        return store

    def nbytes(self) -> dict[int | None, int]:
        """Bytes held per partition."""
        return {p: s.nbytes() for p, s in self._stores.items()}

    def clear(self) -> None:
        self._stores.clear()
