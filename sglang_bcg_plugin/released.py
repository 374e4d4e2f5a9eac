"""Released outputs: zero-copy outputs that live in graph-pool memory (output mode ``released``).

After a capture, the graph's output tensors are replaced by *non-owning aliases* (fresh
storage objects over the same device memory, built with
``torch._C._construct_storage_from_data_pointer``; SGLang's ``sgl_kernel.weak_ref_tensor`` is
the same idea) and every strong reference is dropped. The caching allocator then sees the
output's blocks as free memory of the graph pool, and later captures into that pool reuse them
for their own intermediates. So nothing is resident for outputs (graph memory = the floor),
at a price: a replayed output is valid only until the **next replay of any graph of the same
pool**, which may write its intermediates there. This is vLLM's ``weak_ref_output`` and the
semantics of torch's CUDA Graph Trees.

Only device memory is aliased (``ALIAS_DEVICE_TYPES``): a CPU leaf of an output is not graph
memory and is kept as it is. Engines that do not own their output memory through a graph pool
(the eager engine) keep strong references instead; ``released`` then behaves like ``off``.

The stale-output guard (:mod:`~sglang_bcg_plugin.guard`) covers this mode per graph pool: every
replay of a graph of a pool poisons the released output handed out by the previous replay of
*another* graph of that pool.
"""

from __future__ import annotations

from typing import Any

import torch

from .trees import flatten, unflatten

#: Device types whose output memory is graph-pool memory (tests add ``"cpu"`` with a stand-in
#: graph that keeps its own storage alive).
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
    if isinstance(t, torch.Tensor) and t.device.type in ALIAS_DEVICE_TYPES:
        return alias(t)
    return t


def release_output(output: Any) -> Any:
    """``output`` with every device tensor leaf replaced by a non-owning alias.

    The caller must drop its own references to ``output`` for the memory to go back to the pool.

    :raises RuntimeError: this torch build cannot build aliases.
    """
    if not released_supported():
        msg = (
            "output mode 'released' needs torch._C._construct_storage_from_data_pointer, which "
            f"this torch build ({torch.__version__}) lacks; use output_mode='on' instead"
        )
        raise RuntimeError(msg)
    spec, leaves = flatten(output)
    return unflatten(spec, [maybe_alias(t) for _, t in leaves])
