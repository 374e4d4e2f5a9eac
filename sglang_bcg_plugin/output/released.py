"""Released outputs (output mode ``released``): non-owning aliases of graph-pool memory, valid
until the next replay of any graph of the pool (docs/index.md#the-switch-output-modes)."""

from __future__ import annotations

from typing import Any

import torch

from .trees import flatten, unflatten

#: Device types whose output memory is graph-pool memory (CPU leaves are kept as they are).
ALIAS_DEVICE_TYPES = frozenset({"cuda"})


def released_supported() -> bool:
    """Whether this torch build can build non-owning aliases (CUDA and CPU builds can)."""
    return hasattr(torch._C, "_construct_storage_from_data_pointer")


def alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s memory through a fresh storage object that owns nothing."""
    storage = t.untyped_storage()
    if storage.nbytes() == 0:
        return torch.empty(t.shape, dtype=t.dtype, device=t.device)
    fresh = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), t.device, storage.nbytes())
    out = torch.empty(0, dtype=t.dtype, device=t.device)
    out.set_(fresh, t.storage_offset(), t.shape, t.stride())
    return out


def maybe_alias(t: Any) -> Any:
    """A non-owning alias of ``t`` when it is a tensor in graph-pool memory, else ``t`` itself."""
    return alias(t) if isinstance(t, torch.Tensor) and t.device.type in ALIAS_DEVICE_TYPES else t


def release_output(output: Any) -> Any:
    """``output`` with every device tensor leaf a non-owning alias (drop ``output`` itself for its
    memory to go back to the pool). :raises RuntimeError: this torch build cannot build aliases."""
    if not released_supported():
        raise RuntimeError("output mode 'released' needs torch._C._construct_storage_from_data_pointer, which this "
                           f"torch build ({torch.__version__}) lacks; use output_mode='on' instead")
    spec, leaves = flatten(output)
    return unflatten(spec, [maybe_alias(t) for _, t in leaves])
