"""What the bench captures (the synthetic decoder or transformers' Llama) behind one interface:
per backend the module, a static input at the largest size, and the call for one size."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .model import DecoderConfig, SyntheticDecoder, attention_break, attention_op


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

    def __init__(self, shape: ModelShape) -> None:
        super().__init__(shape)
        self.cfg = DecoderConfig(
            shape.hidden, shape.layers, shape.heads, shape.kv_heads, shape.intermediate, shape.dtype, shape.device
        )
        self.splitting_ops = (torch.ops.sglang_bcg_bench.attention.default,)

    def model_for(self, backend: str, max_tokens: int) -> Callable[..., Any]:
        return SyntheticDecoder(self.cfg, attention=attention_op if backend != "breakable" else attention_break)

    def static_input(self, max_tokens: int) -> torch.Tensor:
        return torch.randn(max_tokens, self.shape.hidden, dtype=self.shape.dtype, device=self.shape.device)

    def call(self, fn: Callable[..., Any], static: torch.Tensor, size: int) -> Any:
        return fn(static[:size])


class LlamaWorkload(Workload):
    """transformers' ``LlamaModel`` with random weights, batch-first ``input_ids`` ``[1, seq]``."""

    name = "llama"
    dynamic_dim = 1
    vocab = 1024

    def __init__(self, shape: ModelShape) -> None:
        super().__init__(shape)
        from . import llama

        llama.register_attention()  # raises TransformersMissingError naming the extra
        llama.llama_config(  # transformers' own checks, before any work (a UsageError)
            hidden=shape.hidden, layers=shape.layers, heads=shape.heads, kv_heads=shape.kv_heads,
            head_dim=shape.head_dim, intermediate=shape.intermediate, max_tokens=16, vocab=self.vocab,
        )
        self.splitting_ops = (torch.ops.sglang_bcg_bench.llama_attention.default,)

    def model_for(self, backend: str, max_tokens: int) -> Callable[..., Any]:
        from .llama import attention_for, build_llama

        s = self.shape
        return build_llama(
            hidden=s.hidden, layers=s.layers, heads=s.heads, kv_heads=s.kv_heads, head_dim=s.head_dim,
            intermediate=s.intermediate, max_tokens=max_tokens, dtype=s.dtype, device=s.device,
            attention=attention_for(backend), vocab=self.vocab,
        )

    def static_input(self, max_tokens: int) -> torch.Tensor:
        return torch.randint(0, self.vocab, (1, max_tokens), device=self.shape.device)

    def refill(self, static: torch.Tensor) -> None:
        static.copy_(torch.randint_like(static, 0, self.vocab))

    def call(self, fn: Callable[..., Any], static: torch.Tensor, size: int) -> Any:
        # A contiguous [1, size] view (``static[:, :size]`` has stride (max, 1), and dynamo would
        # guard on the largest size's contiguity and recompile for the others).
        return fn(input_ids=static[0, :size].unsqueeze(0), use_cache=False)


WORKLOADS: dict[str, type[Workload]] = {"synthetic": SyntheticWorkload, "llama": LlamaWorkload}
