"""Where shared output bytes live: flat storage, viewed by every use in its own shape.

The output-sharing policy (:mod:`~sglang_bcg_plugin.sharing`) keeps one buffer per leaf path per
stream partition that many shape keys reuse. The rule is *storage, not rows*:

* a buffer is one flat (1-D, contiguous) tensor of the leaf's dtype and device, sized for the
  largest use;
* a use is the contiguous view ``flat[:numel].view(shape)`` with the use's own shape, so the
  capture size may live on any dim and several dims may vary: tokens-first ``[tokens, hidden]``,
  batch-first ``[1, seq, hidden]`` and attention's ``[1, heads, seq, head_dim]`` all share;
* a use that needs more bytes than the buffer holds is refused by the policy (per-key fallback:
  capture was not largest-first).

Values crossing a break or a splitting op need no storage of their own: they pass as they are
(``docs/breakable.md``, ``docs/piecewise.md``).
"""

from __future__ import annotations

import torch


def view_of(flat: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """The contiguous ``shape``-shaped view at the start of the flat buffer ``flat``."""
    numel = 1
    for d in shape:
        numel *= d
    return flat[:numel].view(shape)


def flat_of(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` as a flat view of its own elements, or ``None`` when it is not contiguous."""
    if not t.is_contiguous():
        return None
    return t.view(-1)


def copy_broadcast(static: torch.Tensor, value: torch.Tensor, what: str) -> bool:
    """Write ``value`` into a captured ``static`` that broadcasts (a dim of stride 0 and size > 1:
    ``h[:, :1].expand(n, 8)``): such a tensor is a view of fewer elements, one per broadcast dim,
    and those are what a graph replay rewrites (the view then shows the new values). So only
    index 0 of every broadcast dim is written. Returns ``False`` when ``static`` does not broadcast
    (nothing written: the caller's error stands).

    :raises RuntimeError: ``value`` differs along a dim where ``static`` broadcasts (one value
        cannot hold them); ``what`` names the producer.
    """
    dims = [d for d, (size, stride) in enumerate(zip(static.shape, static.stride(), strict=True)) if stride == 0 and size > 1]
    if not dims:
        return False
    dst, src = static, value
    for d in dims:
        dst, src = dst.narrow(d, 0, 1), src.narrow(d, 0, 1)
    dst.copy_(src)
    if all(value.stride(d) == 0 for d in dims):
        return True  # the same broadcast: nothing else to hold
    same = (
        torch.allclose(static, value, rtol=0.0, atol=0.0, equal_nan=True)
        if static.is_floating_point() or static.is_complex()
        else torch.equal(static, value)
    )
    if not same:
        dim = next(d for d in dims if value.stride(d) != 0)
        msg = (
            f"{what} returned values that vary along dim {dim} on replay, where the captured output "
            f"broadcasts one value (stride 0, shape {tuple(static.shape)}); a CUDA graph replays the "
            "broadcast it captured: return the same broadcast (.expand) at every call, or .contiguous()"
        )
        raise RuntimeError(msg)
    return True
