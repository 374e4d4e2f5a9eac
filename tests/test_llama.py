"""transformers' ``LlamaModel`` (random weights, real model code nobody here wrote), every backend.

Storage, not rows: its inputs are batch-first (``input_ids`` ``[1, seq]``), its attention
arguments ``[1, heads, seq, head_dim]`` and its output a ``BaseModelOutputWithPast`` (a dataclass
that is also an ``OrderedDict``) whose ``last_hidden_state`` is ``[1, seq, hidden]``. With sharing
on, every key must share (no fallback), keep transformers' type, and replay what an eager forward
of the same module computes after the input ids changed. CPU: the eager engine (CUDA graphs in
``tests/gpu/test_llama_gpu.py``).
"""

from __future__ import annotations

from sglang_bcg_plugin.output.mode import mode_of_option

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from transformers.modeling_outputs import BaseModelOutputWithPast  # noqa: E402

from sglang_bcg_plugin import BackendOptions, ShapeKey, create_backend  # noqa: E402
from sglang_bcg_plugin.bench.runner import max_abs_error  # noqa: E402
from sglang_bcg_plugin.bench.workload import LlamaWorkload, ModelShape  # noqa: E402

SIZES = (32, 20, 12, 4)
SHAPE = ModelShape(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=96, dtype=torch.float32, device="cpu")


def capture(backend_name: str, share: bool) -> tuple[Any, LlamaWorkload, Any, torch.Tensor]:
    workload = LlamaWorkload(SHAPE)
    model = workload.model_for(backend_name, max(SIZES))
    static = workload.static_input(max(SIZES))
    kwargs: dict[str, Any] = {"splitting_ops": list(workload.splitting_ops)} if backend_name == "piecewise" else {}
    backend = create_backend(backend_name, options=BackendOptions(output_mode=mode_of_option(share), strict_outputs=True), **kwargs)
    fn = backend.compile(model, dynamic_dim=1) if backend_name == "piecewise" else model
    with torch.no_grad(), backend.capture_session():
        for s in SIZES:
            backend.capture_one(ShapeKey(s), lambda s=s: workload.call(fn, static, s), capture_inputs=static)
    return backend, workload, model, static


@pytest.mark.parametrize("backend_name", ["full", "breakable", "piecewise"])
def test_llama_shares_one_output_and_replays_eager(backend_name: str) -> None:
    backend, workload, model, static = capture(backend_name, share=True)
    report = backend.memory_report()
    one_max = max(SIZES) * SHAPE.hidden * 4
    assert not report.fallbacks and all(k.shared for k in report.keys)
    assert report.resident_output_bytes == one_max
    assert report.logical_output_bytes == sum(SIZES) * SHAPE.hidden * 4
    workload.refill(static)
    with torch.no_grad():
        for s in SIZES:
            out = backend.replay(ShapeKey(s))
            assert type(out) is BaseModelOutputWithPast
            assert out["last_hidden_state"] is out.last_hidden_state
            assert out.last_hidden_state.shape == (1, s, SHAPE.hidden)
            ref = workload.call(model, static, s)
            assert max_abs_error(out, ref) == 0.0
    if backend_name == "piecewise":
        assert backend.num_compilations == 1  # type: ignore[attr-defined]


def test_llama_sharing_off_keeps_every_output() -> None:
    backend, workload, model, static = capture("full", share=False)
    report = backend.memory_report()
    assert report.resident_output_bytes == report.logical_output_bytes == sum(SIZES) * SHAPE.hidden * 4
    workload.refill(static)
    with torch.no_grad():
        for s in SIZES:
            assert max_abs_error(backend.replay(ShapeKey(s)), workload.call(model, static, s)) == 0.0


def test_llama_attention_names_compute_the_same_model() -> None:
    workload = LlamaWorkload(SHAPE)
    ids = workload.static_input(24)
    with torch.no_grad():
        outs = [workload.call(workload.model_for(b, 24), ids, 24).last_hidden_state for b in ("full", "breakable", "piecewise")]
        sdpa = workload.model_for("full", 24)
        sdpa.set_attn_implementation("sdpa")
        outs.append(workload.call(sdpa, ids, 24).last_hidden_state)
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0])
    # causal: a prefix of the sequence gives the prefix of the output
    with torch.no_grad():
        short = workload.call(workload.model_for("full", 24), ids, 10).last_hidden_state
    torch.testing.assert_close(short, outs[0][:, :10])
