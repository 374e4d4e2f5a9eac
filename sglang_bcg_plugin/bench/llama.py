"""transformers' ``LlamaModel`` with random weights, built from a ``LlamaConfig`` (no download).

Its attention is transformers' SDPA under names of ours, one per backend: ``sglang_bcg_sdpa``
(Full; under ``"sdpa"`` transformers would build a materialized causal mask under capture),
``sglang_bcg_break`` (a ``@graph_break``), ``sglang_bcg_split`` (a splitting op)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ..breaks import graph_break
from .usage import UsageError

FULL_ATTENTION = "sglang_bcg_sdpa"
BREAK_ATTENTION = "sglang_bcg_break"
SPLIT_ATTENTION = "sglang_bcg_split"


class TransformersMissingError(UsageError):
    """``--model llama`` needs transformers."""


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - transformers is in the test extra
        msg = (
            f"--model llama needs transformers ({exc}); install it with "
            "`pip install transformers` (from a checkout: `pip install -e '.[llama]'`)"
        )
        raise TransformersMissingError(msg) from None
    return transformers


def _sdpa() -> Callable[..., Any]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward  # type: ignore[no-any-return]


@graph_break(reads=("query", "key", "value"))
def break_attention(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any, **kwargs: Any
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention as an eager break point of the Breakable backend."""
    return _sdpa()(module, query, key, value, attention_mask, **kwargs)  # type: ignore[no-any-return]


@torch.library.custom_op("sglang_bcg_bench::llama_attention", mutates_args=())
def split_attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
    """Causal GQA attention ``[1, heads, seq, d]`` -> ``[1, seq, heads, d]``, without a mask and
    without repeating the key/value heads: the splitting op."""
    gqa = query.shape[1] != key.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous()


@split_attention_op.register_fake
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
    # SDPA's output has the query's heads and length and the value's head size.
    return query.new_empty(query.shape[0], query.shape[2], query.shape[1], value.shape[3])


def split_attention(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any, **kwargs: Any
) -> tuple[torch.Tensor, None]:
    """Attention through the splitting op (``attention_mask`` is ``None`` under our name)."""
    scaling: float = kwargs.get("scaling") or module.scaling  # type: ignore[assignment]
    return split_attention_op(query, key, value, float(scaling)), None


@functools.cache
def register_attention() -> None:
    """Register our three attention names with transformers (once per process)."""
    tf = _transformers()
    tf.AttentionInterface.register(FULL_ATTENTION, _sdpa())
    tf.AttentionInterface.register(BREAK_ATTENTION, break_attention)
    tf.AttentionInterface.register(SPLIT_ATTENTION, split_attention)


def attention_for(backend: str) -> str:
    """The attention name each backend runs the model with."""
    return {"breakable": BREAK_ATTENTION, "piecewise": SPLIT_ATTENTION}.get(backend, FULL_ATTENTION)


def llama_config(
    *, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, max_tokens: int, vocab: int
) -> Any:
    """transformers' ``LlamaConfig`` of these sizes (no cache).

    :raises UsageError: transformers rejects it."""
    tf = _transformers()
    try:
        return tf.LlamaConfig(
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=vocab,
            max_position_embeddings=max(max_tokens, 16),
            use_cache=False,
        )
    except Exception as exc:  # ValueError, TypeError, huggingface_hub's StrictDataclassError (5.x)
        cause = exc.__cause__ if isinstance(exc.__cause__, ValueError) else exc
        msg = (
            f"transformers' LlamaConfig rejects --hidden {hidden} --heads {heads} --kv-heads {kv_heads} "
            f"--head-dim {head_dim} --intermediate {intermediate} ({' '.join(str(cause).split())}); change them"
        )
        raise UsageError(msg) from None


def build_llama(
    *,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    intermediate: int,
    max_tokens: int,
    dtype: torch.dtype,
    device: str,
    attention: str = FULL_ATTENTION,
    vocab: int = 1024,
    seed: int = 0,
) -> torch.nn.Module:
    """A ``LlamaModel`` with random weights (seeded: the same weights for every attention name)."""
    tf = _transformers()
    register_attention()
    config = llama_config(
        hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        intermediate=intermediate, max_tokens=max_tokens, vocab=vocab,
    )
    config._attn_implementation = attention
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = tf.LlamaModel(config)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)  # type: ignore[no-any-return]
