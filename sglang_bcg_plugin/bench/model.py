"""A synthetic decoder: RMSNorm, attention through a break/splitting op, MLP; per layer."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..breaks import graph_break


@torch.library.custom_op("sglang_bcg_bench::attention", mutates_args=("out",))
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, num_heads: int,
                 num_kv_heads: int) -> None:
    """Causal prefill attention over ``q.shape[0]`` tokens into ``out`` (the splitting op and break body)."""
    tokens, head_dim = q.shape[0], q.shape[1] // num_heads
    # (1, heads, tokens, head_dim): the fused kernels want 4-D inputs.
    qh = q.reshape(1, tokens, num_heads, head_dim).transpose(1, 2)
    kh, vh = (t.reshape(1, tokens, num_kv_heads, head_dim).transpose(1, 2) for t in (k, v))
    if num_kv_heads != num_heads:
        kh, vh = (t.repeat_interleave(num_heads // num_kv_heads, dim=1) for t in (kh, vh))
    # CUDA: fused kernels only (the math fallback materialises the tokens x tokens scores)
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    with sdpa_kernel(fused) if q.is_cuda else contextlib.nullcontext():
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
    out.copy_(o.transpose(1, 2).reshape(tokens, num_heads * head_dim))


@attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, num_heads: int, num_kv_heads: int) -> None:
    return None


@graph_break(reads=("q", "k", "v"), writes=("out",))
def attention_break(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, num_heads: int,
                    num_kv_heads: int) -> None:
    """The breakable backend's break point: the same attention, run eagerly between segments."""
    attention_op(q, k, v, out, num_heads, num_kv_heads)


@dataclass(frozen=True)
class DecoderConfig:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    dtype: torch.dtype
    device: str
    #: size of one head; ``None``: ``hidden / heads`` (then hidden must be a multiple of heads)
    head_dim: int | None = None

    def __post_init__(self) -> None:
        if self.head_dim is None and self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not a multiple of heads {self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads {self.heads} is not a multiple of kv_heads {self.kv_heads}")


class SyntheticDecoder(torch.nn.Module):
    """``layers`` x (RMSNorm -> qkv -> attention -> o_proj -> residual -> RMSNorm -> MLP); with
    ``world`` > 1, rank ``rank``'s tensor-parallel shard, ``reduce`` the all-reduce."""

    def __init__(self, cfg: DecoderConfig, attention: Callable[..., None] = attention_break, *, rank: int = 0,
                 world: int = 1, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        for what, n in (("heads", cfg.heads), ("kv_heads", cfg.kv_heads), ("intermediate", cfg.intermediate)):
            if n % world:
                raise ValueError(f"{what} {n} does not split over {world} ranks")
        self.cfg, self.attention, self.reduce = cfg, attention, reduce or (lambda x: x)
        head_dim = cfg.head_dim or cfg.hidden // cfg.heads
        self.heads, self.kv_heads = cfg.heads // world, cfg.kv_heads // world
        self.q_cols, self.kv_cols = self.heads * head_dim, self.kv_heads * head_dim
        inter = cfg.intermediate // world
        q_all, kv_all = cfg.heads * head_dim, cfg.kv_heads * head_dim
        g = torch.Generator(device="cpu").manual_seed(0)

        def w(rows: int, cols: int, keep: Callable[[torch.Tensor], torch.Tensor]) -> torch.nn.ParameterList:
            ts = (keep(torch.randn(rows, cols, generator=g) / cols**0.5) for _ in range(cfg.layers))  # one per layer
            return torch.nn.ParameterList(torch.nn.Parameter(t.contiguous().to(cfg.dtype).to(cfg.device),
                                                             requires_grad=False) for t in ts)

        def part(start: int, n: int) -> slice:  # this rank's share of n rows from start
            return slice(start + rank * n, start + (rank + 1) * n)

        def qkv(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t[part(0, self.q_cols)], t[part(q_all, self.kv_cols)],
                              t[part(q_all + kv_all, self.kv_cols)]])

        def gate_up(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t[part(0, inter)], t[part(cfg.intermediate, inter)]])

        self.qkv = w(q_all + 2 * kv_all, cfg.hidden, qkv)
        self.o = w(cfg.hidden, q_all, lambda t: t[:, part(0, self.q_cols)])
        self.gate_up = w(2 * cfg.intermediate, cfg.hidden, gate_up)
        self.down = w(cfg.hidden, cfg.intermediate, lambda t: t[:, part(0, inter)])

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (self.cfg.hidden,), eps=1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for i in range(self.cfg.layers):
            # like a serving kernel stack: in-place adds, references dropped early
            qkv = F.linear(self._norm(h), self.qkv[i])
            q, k, v = qkv.split([self.q_cols, self.kv_cols, self.kv_cols], dim=-1)
            out = torch.empty(h.shape[0], self.q_cols, dtype=h.dtype, device=h.device)
            self.attention(q, k, v, out, self.heads, self.kv_heads)
            del qkv, q, k, v
            attn = self.reduce(F.linear(out, self.o[i]))  # row-parallel o_proj: reduced inside the graph
            del out
            h = h + attn if i == 0 else h.add_(attn)  # never write the static input in place
            del attn
            gate, up = F.linear(self._norm(h), self.gate_up[i]).chunk(2, dim=-1)
            act = F.silu(gate).mul_(up)  # one temporary, like a fused silu_and_mul
            del gate, up
            h.add_(self.reduce(F.linear(act, self.down[i])))  # row-parallel down
            del act
        return self._norm(h)
