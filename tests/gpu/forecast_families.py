"""Transformers model families for the forecast's checks (issue 36), beside the bench's synthetic
decoder and Llama: each differs from those where graph memory differs.

| family | what differs |
|---|---|
| ``qwen2`` | q/k/v biases, GQA 4:1, head_dim 128, gated SiLU MLP, LM head on the last token only (``logits_to_keep=1``: an output leaf that does not scale with the size), bf16 |
| ``gemma`` | head_dim 256, one key/value head (MQA), tied embeddings, GeGLU MLP, the embedding scaled, bf16 |
| ``gpt_neox`` | plain (not gated) GELU MLP, parallel residual, partial rotary, head_dim 64, no GQA, fp16, logits for every token (an output that scales with the vocabulary) |
| ``phi3`` | fused qkv and gate/up projections, GQA 2:1, head_dim 96, fp16, LM head on the last token |

Each is ``XForCausalLM`` from a config with random weights (no download), its attention under the
bench's three names (``sglang_bcg_plugin.bench.workload``), input ``[1, seq]`` token ids; the output
is transformers' ``CausalLMOutputWithPast`` (a dataclass). ``WORKLOADS`` extends the bench's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from sglang_bcg_plugin.bench.workload import (
    BREAK_ATTENTION,
    FULL_ATTENTION,
    SPLIT_ATTENTION,
    WORKLOADS as BENCH_WORKLOADS,
    ModelShape,
    Workload,
    register_attention,
)

#: family -> (config class, model class, config fields, dtype, logits_to_keep)
FAMILIES: dict[str, tuple[str, str, dict[str, Any], torch.dtype, int]] = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=4, num_attention_heads=16,
        num_key_value_heads=4, vocab_size=8192, tie_word_embeddings=False), torch.bfloat16, 1),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=1, head_dim=256, vocab_size=8192, tie_word_embeddings=True), torch.bfloat16, 1),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=4, num_attention_heads=32,
        vocab_size=4096, rotary_pct=0.25, use_parallel_residual=True, tie_word_embeddings=False),
        torch.float16, 0),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=3, num_attention_heads=32,
        num_key_value_heads=16, vocab_size=8192, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False), torch.float16, 1),
}
VOCAB_FOR_INPUT = 4096  # token ids below every family's vocabulary


class FamilyWorkload(Workload):
    """One of :data:`FAMILIES` (``shape``: only its device is used; the family fixes the rest)."""

    dynamic_dim = 1
    family = ""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__(shape)
        register_attention()
        self.splitting_ops = (torch.ops.sglang_bcg_bench.llama_attention.default,)

    def config(self, max_tokens: int, backend: str) -> Any:
        import transformers

        config_cls, _, fields, _, _ = FAMILIES[self.family]
        config = getattr(transformers, config_cls)(max_position_embeddings=max(max_tokens, 16), use_cache=False,
                                                   **fields)
        config._attn_implementation = {"breakable": BREAK_ATTENTION, "piecewise": SPLIT_ATTENTION}.get(
            backend, FULL_ATTENTION)
        return config

    def model_for(self, backend: str, max_tokens: int) -> Callable[..., Any]:
        import transformers

        _, model_cls, _, dtype, _ = FAMILIES[self.family]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = getattr(transformers, model_cls)(self.config(max_tokens, backend))
        return model.to(device=self.shape.device, dtype=dtype).eval().requires_grad_(False)  # type: ignore[no-any-return]

    def static_input(self, max_tokens: int) -> torch.Tensor:
        return torch.randint(0, VOCAB_FOR_INPUT, (1, max_tokens), device=self.shape.device)

    def refill(self, static: torch.Tensor) -> None:
        static.copy_(torch.randint_like(static, 0, VOCAB_FOR_INPUT))

    def call(self, fn: Callable[..., Any], static: torch.Tensor, size: int) -> Any:
        keep = FAMILIES[self.family][4]
        return fn(input_ids=static[0, :size].unsqueeze(0), use_cache=False, logits_to_keep=keep)


WORKLOADS: dict[str, type[Workload]] = dict(BENCH_WORKLOADS)
for _family in FAMILIES:
    WORKLOADS[_family] = type(f"{_family.title()}Workload", (FamilyWorkload,), {"family": _family, "name": _family})
