"""What the bench captures (per backend the module, a static input at the largest size, the call for
one size): the synthetic decoder (``bench/model.py``) or transformers' ``LlamaModel`` with random
weights, its attention under a name of ours per backend (docs/benchmarks.md says why)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..breaks import graph_break
from .model import DecoderConfig, SyntheticDecoder, attention_break, attention_op
from .usage import UsageError

FULL_ATTENTION = "sglang_bcg_sdpa"
BREAK_ATTENTION = "sglang_bcg_break"
SPLIT_ATTENTION = "sglang_bcg_split"


@dataclass(frozen=True)
class ModelShape:
    """The model flags of ``sglang-bcg bench`` (``head_dim`` is used by ``llama`` only)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    dtype: torch.dtype
    device: str


class Workload:
    """Base: a model family the bench can capture."""

    name = "base"
    splitting_ops: tuple[Any, ...] = ()
    dynamic_dim = 0
    #: called between each size's warmup and its capture (a tensor-parallel group's barrier)
    post_warmup_hook: Callable[[], None] | None = None

    def __init__(self, shape: ModelShape) -> None:
        self.shape = shape

    def model_for(self, backend: str, max_tokens: int) -> Callable[..., Any]:  # pragma: no cover - abstract
        raise NotImplementedError

    def static_input(self, max_tokens: int) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def refill(self, static: torch.Tensor) -> None:
        """New input values in place (replay must follow them)."""
        static.copy_(torch.randn_like(static))

    def call(self, fn: Callable[..., Any], static: torch.Tensor, size: int) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError


class SyntheticWorkload(Workload):
    """The synthetic tokens-first decoder (``bench/model.py``)."""

    name = "synthetic"
    splitting_ops = (torch.ops.sglang_bcg_bench.attention.default,)

    def __init__(self, shape: ModelShape) -> None:
        super().__init__(shape)
        self.cfg = DecoderConfig(**{k: v for k, v in vars(shape).items() if k != "head_dim"})  # hidden / heads

    def model_for(self, backend: str, max_tokens: int) -> Callable[..., Any]:
        return SyntheticDecoder(self.cfg, attention=attention_op if backend != "breakable" else attention_break)

    def static_input(self, max_tokens: int) -> torch.Tensor:
        return torch.randn(max_tokens, self.shape.hidden, dtype=self.shape.dtype, device=self.shape.device)

    def call(self, fn: Callable[..., Any], static: torch.Tensor, size: int) -> Any:
        return fn(static[:size])


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - transformers is in the test extra
        raise UsageError(f"--model llama needs transformers ({exc}); install it with `pip install transformers` (from "
                         "a checkout: `pip install -e '.[llama]'`)") from None
    return transformers


def _sdpa() -> Callable[..., Any]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


@graph_break(reads=("query", "key", "value"))
def break_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention as an eager break point of the Breakable backend."""
    return _sdpa()(module, query, key, value, attention_mask, **kwargs)


@torch.library.custom_op("sglang_bcg_bench::llama_attention", mutates_args=())
def split_attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
    """Causal GQA attention ``[1, heads, seq, d]`` -> ``[1, seq, heads, d]``, without a mask and
    without repeating the key/value heads: the splitting op."""
    gqa = query.shape[1] != key.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                                           enable_gqa=gqa)
    return out.transpose(1, 2).contiguous()


@split_attention_op.register_fake
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
    # SDPA's output has the query's heads and length and the value's head size.
    return query.new_empty(query.shape[0], query.shape[2], query.shape[1], value.shape[3])


def split_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
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


def llama_config(shape: ModelShape, max_tokens: int, vocab: int) -> Any:
    """transformers' ``LlamaConfig`` of these sizes (no cache).
    :raises UsageError: transformers rejects it."""
    try:
        return _transformers().LlamaConfig(
            hidden_size=shape.hidden, intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
            num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
            vocab_size=vocab, max_position_embeddings=max(max_tokens, 16), use_cache=False,
        )
    except Exception as exc:  # noqa: BLE001 - ValueError, TypeError, huggingface_hub's StrictDataclassError (5.x)
        cause = exc.__cause__ if isinstance(exc.__cause__, ValueError) else exc
        raise UsageError(f"transformers' LlamaConfig rejects --hidden {shape.hidden} --heads {shape.heads} --kv-heads "
                         f"{shape.kv_heads} --head-dim {shape.head_dim} --intermediate {shape.intermediate} "
                         f"({' '.join(str(cause).split())}); change them") from None


class LlamaWorkload(Workload):
    """transformers' ``LlamaModel`` with random weights, batch-first ``input_ids`` ``[1, seq]``."""

    name = "llama"
    dynamic_dim = 1
    vocab = 1024
    splitting_ops = (torch.ops.sglang_bcg_bench.llama_attention.default,)

    def __init__(self, shape: ModelShape) -> None:
        super().__init__(shape)
        register_attention()  # without transformers: a UsageError naming the extra
        llama_config(shape, 16, self.vocab)  # transformers' own checks, before any work (a UsageError)

    def model_for(self, backend: str, max_tokens: int) -> Callable[..., Any]:
        """A ``LlamaModel`` with random weights (seeded: the same for every backend's attention)."""
        config = llama_config(self.shape, max_tokens, self.vocab)
        names = {"breakable": BREAK_ATTENTION, "piecewise": SPLIT_ATTENTION}
        config._attn_implementation = names.get(backend, FULL_ATTENTION)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = _transformers().LlamaModel(config)
        return model.to(device=self.shape.device, dtype=self.shape.dtype).eval().requires_grad_(False)

    def static_input(self, max_tokens: int) -> torch.Tensor:
        return torch.randint(0, self.vocab, (1, max_tokens), device=self.shape.device)

    def refill(self, static: torch.Tensor) -> None:
        static.copy_(torch.randint_like(static, 0, self.vocab))

    def call(self, fn: Callable[..., Any], static: torch.Tensor, size: int) -> Any:
        # contiguous [1, size]: dynamo would guard on ``static[:, :size]``'s strides and recompile
        return fn(input_ids=static[0, :size].unsqueeze(0), use_cache=False)


WORKLOADS: dict[str, type[Workload]] = {"synthetic": SyntheticWorkload, "llama": LlamaWorkload}
