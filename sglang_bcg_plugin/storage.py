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
