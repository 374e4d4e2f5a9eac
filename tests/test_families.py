"""Model code nobody here wrote, beyond Llama: transformers' Qwen2, Gemma, GPT-NeoX and Phi-3
(``XForCausalLM`` from tiny configs, random weights, CPU, the eager engine) under every backend,
each with the attention it is written for (Full: SDPA; Breakable: SDPA as a ``@graph_break``;
Piecewise: the splitting op, ``dynamic="backed"``). Replay equals an eager forward after the
token ids changed in place, twice, at every size.

What differs between the families is what the backends trace and split (q/k/v biases, MQA, tied
embeddings, parallel residual, partial rotary, fused projections, an LM head on the last token
only); the output modes are the same code for every model, so Full and Breakable run each
family in all three and Piecewise, whose compile dominates the time, in one mode per family
(together all three)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sglang_bcg_plugin import BackendOptions, ShapeKey, create_backend

transformers = pytest.importorskip("transformers")
from sglang_bcg_plugin.bench.workload import (  # noqa: E402 - needs transformers
    BREAK_ATTENTION,
    FULL_ATTENTION,
    SPLIT_ATTENTION,
    register_attention,
)

pytestmark = pytest.mark.slow

VOCAB = 96
SIZES = [12, 7, 1]  # largest first; 1: Piecewise's "backed" specializes it (a second compile)
#: family -> (config class, model class, config fields, logits_to_keep, Piecewise's output mode)
FAMILIES: dict[str, tuple[str, str, dict[str, Any], int, str]] = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        tie_word_embeddings=False), 1, "off"),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        head_dim=16, tie_word_embeddings=True), 1, "on"),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, rotary_pct=0.25,
        use_parallel_residual=True, tie_word_embeddings=False), 0, "released"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False), 1, "on"),
}
ATTENTION = {"full": FULL_ATTENTION, "breakable": BREAK_ATTENTION, "piecewise": SPLIT_ATTENTION}


def _model(family: str, backend: str) -> Any:
    register_attention()
    config_cls, model_cls, fields, _, _ = FAMILIES[family]
    config = getattr(transformers, config_cls)(vocab_size=VOCAB, max_position_embeddings=32, use_cache=False, **fields)
    config._attn_implementation = ATTENTION[backend]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return getattr(transformers, model_cls)(config).eval().requires_grad_(False)


def _cases() -> list[Any]:
    cases = []
    for family, (*_, piecewise_mode) in FAMILIES.items():
        cases += [pytest.param(family, name, mode, id=f"{family}-{name}-{mode}")
                  for name in ("full", "breakable") for mode in ("off", "on", "released")]
        cases.append(pytest.param(family, "piecewise", piecewise_mode, id=f"{family}-piecewise-{piecewise_mode}"))
    return cases


def family_case(family: str, name: str, mode: str, device: str = "cpu", engine: str = "eager",
                dtype: torch.dtype = torch.float32) -> None:
    """Capture ``SIZES`` (largest first), then twice: the ids change in place and every size's
    replay equals the module's eager forward on the new ids."""
    model, keep = _model(family, name).to(device=device, dtype=dtype), FAMILIES[family][3]
    ids = torch.randint(0, VOCAB, (1, SIZES[0]), generator=torch.Generator().manual_seed(1)).to(device)
    backend = create_backend(name, options=BackendOptions(output_mode=mode, engine=engine),
                             **({"splitting_ops": [torch.ops.sglang_bcg_bench.llama_attention.default]}
                                if name == "piecewise" else {}))
    fn = backend.compile(model, dynamic="backed", dynamic_dim=1) if name == "piecewise" else model

    def forward(run: Any, size: int) -> torch.Tensor:
        # contiguous [1, size] ids; the logits (the rows the LM head keeps) are the tensor leaf
        return run(input_ids=ids[0, :size].unsqueeze(0), use_cache=False, logits_to_keep=keep).logits

    with torch.no_grad(), backend.capture_session():
        for size in SIZES:
            backend.capture_one(ShapeKey(size), lambda size=size: forward(fn, size), capture_inputs=ids)
    for _ in range(2):
        ids.copy_(torch.randint(0, VOCAB, ids.shape, device=device))
        for size in SIZES:  # each checked right after its replay: released outputs share memory
            got = backend.replay(ShapeKey(size))
            with torch.no_grad():
                want = forward(model, size)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, msg=lambda m, size=size: f"{family} {name} {mode} size {size}: {m}")


@pytest.mark.parametrize(("family", "name", "mode"), _cases())
def test_transformers_family_replays_eager(family: str, name: str, mode: str) -> None:
    family_case(family, name, mode)
