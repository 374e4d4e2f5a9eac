"""transformers' ``LlamaModel`` on real CUDA graphs, every backend, both shared-buffer sources.

Real model code nobody here wrote (random weights from a config): batch-first ``input_ids``,
attention arguments ``[1, heads, seq, head_dim]``, a ``BaseModelOutputWithPast`` output. Replay
must equal an eager forward of the same module after the input ids changed, for every size;
with sharing on, every key shares, transformers' output type survives, one max-size output is
resident, and the Breakable bridges hold one layer's attention inputs (not one per size).
"""

from __future__ import annotations

from sglang_bcg_plugin.output.mode import mode_of_option

from typing import Any

import pytest
import torch

from sglang_bcg_plugin import BackendOptions, ShapeKey, create_backend
from sglang_bcg_plugin.bench.runner import max_abs_error
from sglang_bcg_plugin.bench.sizes import prefill_capture_sizes
from sglang_bcg_plugin.bench.workload import LlamaWorkload, ModelShape

pytestmark = pytest.mark.cuda
pytest.importorskip("transformers")

SIZES = sorted(prefill_capture_sizes(1024), reverse=True)
SHAPE = ModelShape(hidden=512, layers=2, heads=8, kv_heads=2, head_dim=64, intermediate=768, dtype=torch.bfloat16, device="cuda")


def _capture(backend_name: str, share: bool, source: str = "auto") -> tuple[Any, LlamaWorkload, Any, torch.Tensor]:
    workload = LlamaWorkload(SHAPE)
    model = workload.model_for(backend_name, max(SIZES))
    static = workload.static_input(max(SIZES))
    kwargs: dict[str, Any] = {"splitting_ops": list(workload.splitting_ops)} if backend_name == "piecewise" else {}
    options = BackendOptions(output_mode=mode_of_option(share), strict_outputs=True, engine="cuda", shared_buffer=source)  # type: ignore[arg-type]
    backend = create_backend(backend_name, options=options, **kwargs)
    fn = backend.compile(model, dynamic_dim=1) if backend_name == "piecewise" else model
    with torch.no_grad(), backend.capture_session():
        for s in SIZES:
            backend.capture_one(ShapeKey(s), lambda s=s: workload.call(fn, static, s), capture_inputs=static)
    return backend, workload, model, static


@pytest.mark.parametrize("source", ["adopt", "reserve"])
@pytest.mark.parametrize("backend_name", ["full", "breakable", "piecewise"])
def test_llama_on_cuda_graphs(backend_name: str, source: str) -> None:
    from transformers.modeling_outputs import BaseModelOutputWithPast

    backend, workload, model, static = _capture(backend_name, True, source)
    try:
        report = backend.memory_report()
        assert not report.fallbacks and all(k.shared for k in report.keys)
        assert report.resident_output_bytes == max(SIZES) * SHAPE.hidden * 2
        workload.refill(static)
        with torch.no_grad():
            for s in SIZES:
                out = backend.replay(ShapeKey(s))
                assert type(out) is BaseModelOutputWithPast and out["last_hidden_state"] is out.last_hidden_state
                assert max_abs_error(out, workload.call(model, static, s)) == 0.0, s
        if backend_name == "breakable":
            # q [1, heads, S, d] + k, v [1, kv_heads, S, d]: one layer's break arguments at the
            # largest size; the returned attention output reuses the dead q slot.
            one_layer = (SHAPE.heads + 2 * SHAPE.kv_heads) * max(SIZES) * SHAPE.head_dim * 2
            assert report.total_bridge_bytes <= 1.1 * one_layer, (report.total_bridge_bytes, one_layer)
        if backend_name == "piecewise":
            assert backend.num_compilations == 1
    finally:
        backend.cleanup()


@pytest.mark.parametrize("backend_name", ["full", "breakable", "piecewise"])
def test_llama_sharing_off_on_cuda_graphs(backend_name: str) -> None:
    backend, workload, model, static = _capture(backend_name, False)
    try:
        report = backend.memory_report()
        assert report.resident_output_bytes == report.logical_output_bytes
        workload.refill(static)
        with torch.no_grad():
            for s in SIZES:
                assert max_abs_error(backend.replay(ShapeKey(s)), workload.call(model, static, s)) == 0.0, s
    finally:
        backend.cleanup()
