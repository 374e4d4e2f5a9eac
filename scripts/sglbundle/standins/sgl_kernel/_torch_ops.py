"""Pure-torch versions of the sgl-kernel ops SGLang's dense-model path calls (the stand-in's).

Each follows the call signature and the in-place contract of sgl-kernel's Python wrapper
(``out=``, ``enable_pdl=``; ``fused_add_rmsnorm`` and ``rotary_embedding`` write their
arguments) and computes what SGLang's own ``forward_native`` computes: in float32, cast back to
the input's dtype. No host syncs and no value-dependent shapes, so they capture in CUDA graphs.
Reference implementations, several kernels each: correct, not fast.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _normed(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)


def _into(value: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return value
    out.copy_(value)
    return out


def rmsnorm(input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,  # noqa: A002 - sgl-kernel's name
            out: torch.Tensor | None = None, enable_pdl: bool | None = None) -> torch.Tensor:
    """``input * rsqrt(mean(input**2) + eps) * weight``, over the last dim."""
    return _into((_normed(input, eps) * weight.float()).to(input.dtype), out)


def fused_add_rmsnorm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,  # noqa: A002
                      eps: float = 1e-6, enable_pdl: bool | None = None) -> None:
    """In place: ``residual = input + residual``, then ``input = rmsnorm(residual) * weight``."""
    summed = input.float() + residual.float()
    residual.copy_(summed.to(residual.dtype))
    input.copy_((_normed(summed, eps) * weight.float()).to(input.dtype))


def gemma_rmsnorm(input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,  # noqa: A002
                  out: torch.Tensor | None = None, enable_pdl: bool | None = None) -> torch.Tensor:
    """Gemma's RMSNorm: the weight is applied as ``1 + weight``."""
    return _into((_normed(input, eps) * (1.0 + weight.float())).to(input.dtype), out)


def gemma_fused_add_rmsnorm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,  # noqa: A002
                            eps: float = 1e-6, enable_pdl: bool | None = None) -> None:
    """In place, as :func:`fused_add_rmsnorm` with Gemma's ``1 + weight``."""
    summed = input.float() + residual.float()
    residual.copy_(summed.to(residual.dtype))
    input.copy_((_normed(summed, eps) * (1.0 + weight.float())).to(input.dtype))


def _gated(act: str, input: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:  # noqa: A002
    half = input.shape[-1] // 2
    gate, up = input[..., :half], input[..., half:]
    if act == "silu":
        value = F.silu(gate) * up
    else:
        value = F.gelu(gate, approximate=act) * up
    return _into(value, out)


def silu_and_mul(input: torch.Tensor, out: torch.Tensor | None = None,  # noqa: A002
                 enable_pdl: bool | None = None) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for an input of last dim ``2d``."""
    return _gated("silu", input, out)


def gelu_and_mul(input: torch.Tensor, out: torch.Tensor | None = None,  # noqa: A002
                 enable_pdl: bool | None = None) -> torch.Tensor:
    """``gelu(x[..., :d]) * x[..., d:]`` (the exact erf GELU)."""
    return _gated("none", input, out)


def gelu_tanh_and_mul(input: torch.Tensor, out: torch.Tensor | None = None,  # noqa: A002
                      enable_pdl: bool | None = None) -> torch.Tensor:
    """``gelu_tanh(x[..., :d]) * x[..., d:]``."""
    return _gated("tanh", input, out)


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None,
                     head_size: int, cos_sin_cache: torch.Tensor, is_neox: bool = True) -> None:
    """Rotary embedding in place on ``query`` and ``key`` (``[tokens, heads * head_size]`` or
    ``[tokens, heads, head_size]``): ``cos_sin_cache[positions]`` holds ``rot_dim / 2`` cosines
    then as many sines; the first ``rot_dim`` dims of each head rotate (NeoX halves, or GPT-J
    interleaved pairs)."""
    cos, sin = cos_sin_cache.index_select(0, positions.reshape(-1).long()).float().chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [tokens, 1, rot_dim / 2]
    rot = 2 * cos.shape[-1]

    def rotate(t: torch.Tensor) -> None:
        heads = t.view(t.shape[0], -1, head_size)
        part = heads[..., :rot].float()
        if is_neox:
            x1, x2 = part.chunk(2, dim=-1)
            value = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            x1, x2 = part[..., 0::2], part[..., 1::2]
            value = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        heads[..., :rot] = value.to(t.dtype)

    rotate(query)
    if key is not None:
        rotate(key)


def _per_row(value: torch.Tensor | float | int, rows: int, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(device=like.device, dtype=dtype).reshape(-1, 1).expand(rows, 1)
    return torch.full((rows, 1), value, device=like.device, dtype=dtype)


def top_k_renorm_prob(probs: torch.Tensor, top_k: torch.Tensor | int) -> torch.Tensor:
    """Keep each row's ``top_k`` largest probabilities (ties at the k-th kept), renormalised."""
    rows, vocab = probs.shape
    k = _per_row(top_k, rows, probs, torch.int64).clamp(1, vocab)
    kth = probs.sort(dim=-1, descending=True).values.gather(1, k - 1)
    kept = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    return kept / kept.sum(dim=-1, keepdim=True)


def top_p_renorm_prob(probs: torch.Tensor, top_p: torch.Tensor | float) -> torch.Tensor:
    """Keep each row's smallest set of largest probabilities whose sum reaches ``top_p`` (the
    largest always), renormalised."""
    rows = probs.shape[0]
    p = _per_row(top_p, rows, probs, probs.dtype)
    ordered, order = probs.sort(dim=-1, descending=True)
    keep_sorted = (ordered.cumsum(dim=-1) - ordered) < p
    keep_sorted[:, 0] = True
    keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    return kept / kept.sum(dim=-1, keepdim=True)
