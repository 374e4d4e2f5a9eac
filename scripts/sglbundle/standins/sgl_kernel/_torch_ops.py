"""Pure-torch versions of the sgl_kernel ops SGLang calls on CUDA (see the package docstring).

Each function has the signature and in-place behaviour of sgl-kernel's Python wrapper of the
same name (``sgl_kernel/elementwise.py``, ``sgl_kernel/sampling.py``) and the arithmetic of
SGLang's own ``forward_native`` of the layer that calls it, so a server using these computes
what ``SGLANG_FORCE_FUSED_OP_BACKEND=torch`` computes. ``enable_pdl`` is accepted and ignored
(there is no kernel launch to make dependent).

All of them are built from torch operators only, with no host synchronisation (no ``.item()``,
no data-dependent shapes), so they can be captured in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = [
    "fused_add_rmsnorm",
    "gelu_and_mul",
    "gelu_tanh_and_mul",
    "gemma_fused_add_rmsnorm",
    "gemma_rmsnorm",
    "rmsnorm",
    "rotary_embedding",
    "silu_and_mul",
    "top_k_renorm_prob",
    "top_k_renorm_probs",
    "top_p_renorm_prob",
    "top_p_renorm_probs",
]


# --- norms ------------------------------------------------------------------------------------


def _normalize(x32: torch.Tensor, eps: float) -> torch.Tensor:
    """``x32 / RMS(x32)`` over the last dimension, in float32."""
    variance = x32.pow(2).mean(dim=-1, keepdim=True)
    return x32 * torch.rsqrt(variance + eps)


def _check_norm(name: str, input: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.dim() != 1 or weight.shape[0] != input.shape[-1]:
        msg = (
            f"sgl_kernel.{name}: weight must have shape ({input.shape[-1]},) to match the last "
            f"dimension of input {tuple(input.shape)}, got {tuple(weight.shape)}"
        )
        raise ValueError(msg)


def _write(name: str, dst: torch.Tensor, value: torch.Tensor, what: str) -> None:
    if dst.shape != value.shape:
        msg = f"sgl_kernel.{name}: {what} must have shape {tuple(value.shape)}, got {tuple(dst.shape)}"
        raise ValueError(msg)
    dst.copy_(value)


def rmsnorm(
    input: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    out: torch.Tensor | None = None,
    enable_pdl: bool | None = None,
) -> torch.Tensor:
    """``out = input / RMS(input) * weight`` (float32 math, result in ``input``'s dtype).

    Writes ``out`` when given (``input`` is not modified) and returns it; else returns a new tensor.
    """
    _check_norm("rmsnorm", input, weight)
    y = (_normalize(input.float(), eps) * weight.float()).to(input.dtype)
    if out is None:
        return y
    _write("rmsnorm", out, y, "out")
    return out


def fused_add_rmsnorm(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    enable_pdl: bool | None = None,
) -> None:
    """In place: ``residual += input``, then ``input = residual / RMS(residual) * weight``.

    The sum is taken in float32 and normalized unrounded (as ``RMSNorm.forward_native``); the
    sum written to ``residual`` is rounded to its dtype. Returns ``None``.
    """
    _check_norm("fused_add_rmsnorm", input, weight)
    total = input.float() + residual.float()
    y = (_normalize(total, eps) * weight.float()).to(input.dtype)
    _write("fused_add_rmsnorm", residual, total.to(residual.dtype), "residual")
    input.copy_(y)


def gemma_rmsnorm(
    input: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    out: torch.Tensor | None = None,
    enable_pdl: bool | None = None,
) -> torch.Tensor:
    """``out = input / RMS(input) * (1 + weight)`` (float32 math, result in ``input``'s dtype)."""
    _check_norm("gemma_rmsnorm", input, weight)
    y = (_normalize(input.float(), eps) * (1.0 + weight.float())).to(input.dtype)
    if out is None:
        return y
    _write("gemma_rmsnorm", out, y, "out")
    return out


def gemma_fused_add_rmsnorm(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    enable_pdl: bool | None = None,
) -> None:
    """In place: ``residual += input``, then ``input = residual / RMS(residual) * (1 + weight)``.

    As ``GemmaRMSNorm.forward_native``: the sum is rounded to ``input``'s dtype first, and that
    rounded sum is what is normalized. Returns ``None``.
    """
    _check_norm("gemma_fused_add_rmsnorm", input, weight)
    total = input + residual
    y = (_normalize(total.float(), eps) * (1.0 + weight.float())).to(input.dtype)
    _write("gemma_fused_add_rmsnorm", residual, total.to(residual.dtype), "residual")
    input.copy_(y)


# --- activations ------------------------------------------------------------------------------


def _act_and_mul(name: str, act: Callable[[torch.Tensor], torch.Tensor], input: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    d = input.shape[-1] // 2
    if input.shape[-1] != 2 * d:
        msg = f"sgl_kernel.{name}: the last dimension of input must be even, got {tuple(input.shape)}"
        raise ValueError(msg)
    y = act(input[..., :d]) * input[..., d:]
    if out is None:
        return y
    _write(name, out, y, "out")
    return out


def silu_and_mul(input: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` with ``d = x.shape[-1] // 2``; writes ``out`` if given."""
    return _act_and_mul("silu_and_mul", F.silu, input, out)


def _gelu_none(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="none")


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def gelu_and_mul(input: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``gelu(x[..., :d]) * x[..., d:]`` (exact erf GELU); writes ``out`` if given."""
    return _act_and_mul("gelu_and_mul", _gelu_none, input, out)


def gelu_tanh_and_mul(input: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``gelu_tanh(x[..., :d]) * x[..., d:]`` (tanh approximation); writes ``out`` if given."""
    return _act_and_mul("gelu_tanh_and_mul", _gelu_tanh, input, out)


# --- rotary embedding -------------------------------------------------------------------------


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    """Rotate ``x`` [tokens, heads, rot_dim] by ``cos``/``sin`` [tokens, rot_dim // 2] (new tensor)."""
    cos = cos.unsqueeze(-2).to(x.dtype)
    sin = sin.unsqueeze(-2).to(x.dtype)
    if is_neox:
        x1, x2 = x.chunk(2, dim=-1)
    else:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox:
        return torch.cat((o1, o2), dim=-1)
    return torch.stack((o1, o2), dim=-1).flatten(-2)


def _rope_inplace(
    name: str, x: torch.Tensor, num_tokens: int, head_size: int, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool
) -> None:
    rot_dim = 2 * cos.shape[-1]
    if x.numel() == 0 and num_tokens == 0:
        return
    if num_tokens == 0 or x.numel() % (num_tokens * head_size) != 0:
        msg = (
            f"sgl_kernel.rotary_embedding: {name} of shape {tuple(x.shape)} is not "
            f"[{num_tokens} tokens, heads * {head_size}] (or [tokens, heads, {head_size}])"
        )
        raise ValueError(msg)
    if rot_dim > head_size:
        msg = f"sgl_kernel.rotary_embedding: cos_sin_cache's rotary dim {rot_dim} exceeds head_size {head_size}"
        raise ValueError(msg)
    try:
        heads = x.view(num_tokens, -1, head_size)
    except RuntimeError:  # a layout a view cannot split: rotate a copy, write it back whole
        heads = x.reshape(num_tokens, -1, head_size)
        heads[..., :rot_dim] = _rotate(heads[..., :rot_dim], cos, sin, is_neox)
        x.copy_(heads.view(x.shape))
        return
    heads[..., :rot_dim] = _rotate(heads[..., :rot_dim], cos, sin, is_neox)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> None:
    """Rotary position embedding, in place on ``query`` and ``key`` (vLLM/sgl-kernel layout).

    ``query``/``key``: [tokens, heads * head_size] (or [tokens, heads, head_size]);
    ``cos_sin_cache``: [max_position, rot_dim], cos in the first half of the last dimension, sin
    in the second; the first ``rot_dim`` of each head are rotated, the rest left as they are.
    ``is_neox``: rotate the two halves (NeoX) rather than even/odd pairs (GPT-J). The math is
    ``RotaryEmbedding.forward_native``'s (cos/sin cast to the query's dtype). ``key`` may be
    ``None``. Returns ``None``.
    """
    positions = positions.flatten()
    num_tokens = positions.shape[0]
    cos, sin = cos_sin_cache.index_select(0, positions.long()).chunk(2, dim=-1)
    _rope_inplace("query", query, num_tokens, head_size, cos, sin, is_neox)
    if key is not None:
        _rope_inplace("key", key, num_tokens, head_size, cos, sin, is_neox)


# --- sampling ---------------------------------------------------------------------------------


def _per_row(value: torch.Tensor | float, rows: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``value`` (a tensor of one value per row, or one Python number) as a [rows, 1] tensor."""
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=dtype).reshape(-1, 1).expand(rows, 1)
    return torch.full((rows, 1), value, dtype=dtype, device=device)


def _keep_from_threshold(probs: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    kept = torch.where(probs >= threshold, probs, torch.zeros_like(probs))
    return kept / kept.sum(dim=-1, keepdim=True)


def top_k_renorm_probs(probs: torch.Tensor, top_k: torch.Tensor | int) -> torch.Tensor:
    """Keep each row's ``top_k`` largest probabilities, zero the rest, renormalize (float32 result).

    ``top_k``: one int for every row, or a tensor of one per row. Every probability equal to the
    k-th largest is kept (so ties at the cut may keep more than k); ``k <= 0`` or ``k >= vocab``
    keeps the whole row. ``probs`` is not modified.
    """
    probs = probs.float()
    vocab = probs.shape[-1]
    k = _per_row(top_k, probs.shape[0], torch.long, probs.device)
    k = torch.where((k <= 0) | (k > vocab), torch.full_like(k, vocab), k)
    ordered = probs.sort(dim=-1, descending=True).values
    return _keep_from_threshold(probs, ordered.gather(-1, k - 1))


def top_p_renorm_probs(probs: torch.Tensor, top_p: torch.Tensor | float) -> torch.Tensor:
    """Keep the smallest set of each row's largest probabilities whose sum reaches ``top_p``,
    zero the rest, renormalize (float32 result).

    ``top_p``: one float for every row, or a tensor of one per row. A token is kept when the
    probability mass strictly above it (in descending order) is below ``top_p``; the largest is
    always kept, and every probability equal to the last one kept is kept too.
    ``probs`` is not modified.
    """
    probs = probs.float()
    p = _per_row(top_p, probs.shape[0], torch.float32, probs.device)
    ordered = probs.sort(dim=-1, descending=True).values
    mass_before = ordered.cumsum(dim=-1) - ordered
    keep = mass_before < p
    keep[..., 0] = True
    last = keep.sum(dim=-1, keepdim=True) - 1
    return _keep_from_threshold(probs, ordered.gather(-1, last))


top_k_renorm_prob = top_k_renorm_probs
top_p_renorm_prob = top_p_renorm_probs
