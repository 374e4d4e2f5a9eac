"""Write a LlamaForCausalLM model directory offline: ``config.json`` and an HF tokenizer, no weights.

SGLang serves it with ``--load-format dummy`` (its seeded random init: every process gets the same
weights), so a real ``sglang.Engine`` / ``launch_server`` runs without a download. The tokenizer is
a byte-level BPE trained with the ``tokenizers`` library on a few sentences.

    python scripts/server/make_model.py OUT_DIR [--hidden 2048 --layers 8 ...]
    python scripts/server/make_model.py OUT_DIR --shape llama3-8b     # Llama-3-8B's shapes

``make_model(out, **shape)`` is the same from Python (the server tests import it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

#: The tiny model the server tests use: small enough to start in seconds, shaped like a real
#: Llama where SGLang's kernels care (head_dim 128, GQA 4:1).
TINY: dict[str, int] = dict(hidden=2048, layers=8, heads=16, kv_heads=4, head_dim=128,
                            intermediate=5632, vocab=384, max_pos=8192)
#: Llama-3-8B's shapes (one 16384-token prefill output in bf16 is 128 MiB).
LLAMA3_8B: dict[str, int] = dict(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128,
                                 intermediate=14336, vocab=128256, max_pos=32768)
SHAPES = {"tiny": TINY, "llama3-8b": LLAMA3_8B}

#: head_dim values SGLang's rope runs without a JIT-compiled kernel.
HEAD_DIMS = (64, 128, 256, 512)
_SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "SGLang serves language models with radix attention and CUDA graphs.",
    "Hello world! 0123456789 def main(): return 42",
    "Breakable graphs share one output buffer across every capture size.",
]


def _check(shape: dict[str, int]) -> None:
    for name, value in shape.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            msg = f"make_model: {name} must be a positive int, got {value!r}"
            raise ValueError(msg)
    if shape["head_dim"] not in HEAD_DIMS:
        msg = f"make_model: head_dim {shape['head_dim']} is not one of {HEAD_DIMS} (SGLang would JIT its rope)"
        raise ValueError(msg)
    if shape["heads"] % shape["kv_heads"]:
        msg = f"make_model: heads ({shape['heads']}) must be a multiple of kv_heads ({shape['kv_heads']})"
        raise ValueError(msg)
    if shape["vocab"] < 300:
        msg = f"make_model: vocab must be at least 300 (the byte alphabet and specials), got {shape['vocab']}"
        raise ValueError(msg)


def _tokenizer(out: Path, vocab: int, max_pos: int) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(vocab, 512), special_tokens=_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 50, trainer)
    tok.save(str(out / "tokenizer.json"))
    specials = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    _write(out / "tokenizer_config.json", {"tokenizer_class": "PreTrainedTokenizerFast", **specials,
                                           "model_max_length": max_pos, "chat_template": template})
    _write(out / "special_tokens_map.json", specials)
    return int(tok.get_vocab_size())


def _write(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=1) + "\n")


def make_model(out: str | Path, **shape: int) -> Path:
    """Write the model directory ``out`` (created) and return it.

    :param shape: any of ``hidden``, ``layers``, ``heads``, ``kv_heads``, ``head_dim``,
        ``intermediate``, ``vocab``, ``max_pos``; the rest from :data:`TINY`.
    :raises ValueError: an unknown shape name or a value SGLang cannot serve without a JIT.
    """
    unknown = sorted(set(shape) - set(TINY))
    if unknown:
        msg = f"make_model: unknown shape names {unknown}; known: {sorted(TINY)}"
        raise ValueError(msg)
    full = {**TINY, **shape}
    _check(full)
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    token_count = _tokenizer(path, full["vocab"], full["max_pos"])
    if token_count > full["vocab"]:
        msg = f"make_model: the tokenizer has {token_count} tokens, more than vocab {full['vocab']}"
        raise ValueError(msg)
    ids = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}
    _write(path / "config.json", {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": full["vocab"], "hidden_size": full["hidden"],
        "intermediate_size": full["intermediate"], "num_hidden_layers": full["layers"],
        "num_attention_heads": full["heads"], "num_key_value_heads": full["kv_heads"],
        "head_dim": full["head_dim"], "hidden_act": "silu",
        "max_position_embeddings": full["max_pos"], "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "attention_bias": False,
        "mlp_bias": False, **ids,
    })
    _write(path / "generation_config.json", ids)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny", help="start from these shapes")
    for name in TINY:
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, dest=name, help=f"override {name}")
    args = ap.parse_args(argv)
    shape = {**SHAPES[args.shape], **{k: getattr(args, k) for k in TINY if getattr(args, k) is not None}}
    try:
        path = make_model(args.out, **shape)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"model: {json.dumps(shape)} -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
