"""Piecewise with Inductor-compiled pieces on real CUDA graphs (Triton; skipped without CUDA).

The compilation (Triton kernels, their first-call autotuning) must happen in the warmups, never
inside a capture; one compilation per piece serves every size; replay equals the compiled
callable run without graphs and, within tolerance, the uncompiled model, after the inputs
changed. Errors are printed (and written to ``$SGLANG_BCG_GPU_RESULTS_DIR`` when set).
"""

from __future__ import annotations

from sglang_bcg_plugin.output.mode import mode_of_option

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from sglang_bcg_plugin import BackendOptions, ShapeKey, create_backend
from sglang_bcg_plugin.backends.piecewise import PiecewiseBackend
from sglang_bcg_plugin.bench.runner import max_abs_error
from sglang_bcg_plugin.bench.sizes import prefill_capture_sizes

from splitting_ops import mix, write_softmax  # tests/splitting_ops.py

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the H200 machine)"),
    # Inductor's advice for fp32 matmuls on this GPU, and its own internals: not ours to fix.
    pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores"),
    pytest.mark.filterwarnings("ignore::UserWarning:torch._inductor.*"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:triton.*"),
]

SIZES = [1024, 768, 512, 384, 256, 128, 64, 32, 16, 8, 4, 2, 1]
H = 256


class Mixed(torch.nn.Module):
    """Strided values crossing a splitting call, a written buffer, outputs aliasing the input."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.register_buffer("w0", (torch.randn(H, 3 * H, generator=g) / H**0.5).cuda())
        self.register_buffer("w1", (torch.randn(H, H, generator=g) / H**0.5).cuda())

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> dict[str, torch.Tensor]:
        qkv = x @ self.w0 + pos[:, None]
        q, k, v = qkv.split([H, H, H], dim=-1)
        h = mix(q) * k + v
        out = torch.empty_like(h)
        write_softmax(h, out)
        y = torch.nn.functional.rms_norm(out * 2.0 + h, (H,))
        return {"y": torch.relu(y @ self.w1), "t": (h * 0.5).t(), "x": x[:, :2]}


def _record(name: str, value: Any) -> None:
    print(f"{name}: {value}")
    out_dir = os.environ.get("SGLANG_BCG_GPU_RESULTS_DIR")
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / f"{name}.json").write_text(json.dumps(value, indent=2))


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("share", [False, True], ids=["share_off", "share_on"])
def test_inductor_pieces_on_cuda_graphs(share: bool) -> None:
    backend = create_backend(
        "piecewise", options=BackendOptions(output_mode=mode_of_option(share), engine="cuda"), splitting_ops=[mix, write_softmax], inductor=True
    )
    assert isinstance(backend, PiecewiseBackend)
    model = Mixed()
    fn = backend.compile(model)
    x, pos = torch.randn(max(SIZES), H, device="cuda"), torch.randn(max(SIZES), device="cuda")
    after_first: list[int] = []
    with torch.no_grad(), backend.capture_session():
        for s in SIZES:
            backend.capture_one(ShapeKey(s), lambda s=s: fn(x[:s], pos[:s]), capture_inputs=(x, pos))
            after_first.append(backend.num_piece_compilations)
    try:
        assert after_first == [3] * len(SIZES)  # compiled in the first warmup, never again
        assert backend.num_compilations == 1
        assert {backend.num_segments(ShapeKey(s)) for s in SIZES} == {3}
        errs = {"vs_compiled": 0.0, "vs_eager": 0.0}
        x.copy_(torch.randn_like(x))
        pos.copy_(torch.randn_like(pos))
        with torch.no_grad():
            for s in [1, 1024, 64, 384, 2, 768, 4, 512, 8, 256, 16, 128, 32]:
                got = {k: t.clone() for k, t in backend.replay(ShapeKey(s)).items()}
                errs["vs_compiled"] = max(errs["vs_compiled"], max_abs_error(got, fn(x[:s], pos[:s])))
                errs["vs_eager"] = max(errs["vs_eager"], max_abs_error(got, model(x[:s], pos[:s])))
        _record(f"piecewise_inductor_mixed_{'on' if share else 'off'}", {**errs, "compile_s": backend.compile_seconds})
        assert errs["vs_compiled"] <= 1e-6
        assert errs["vs_eager"] <= 1e-3
        assert not backend.memory_report().fallbacks
    finally:
        backend.cleanup()


def test_llama_inductor_pieces_bf16() -> None:
    pytest.importorskip("transformers")
    from sglang_bcg_plugin.bench.workload import LlamaWorkload, ModelShape

    sizes = sorted(prefill_capture_sizes(1024), reverse=True)
    shape = ModelShape(hidden=512, layers=2, heads=8, kv_heads=2, head_dim=64, intermediate=768, dtype=torch.bfloat16, device="cuda")
    workload = LlamaWorkload(shape)
    model = workload.model_for("piecewise", max(sizes))
    static = workload.static_input(max(sizes))
    backend = create_backend(
        "piecewise",
        options=BackendOptions(output_mode="on", strict_outputs=True, engine="cuda"),
        splitting_ops=list(workload.splitting_ops),
        inductor=True,
    )
    assert isinstance(backend, PiecewiseBackend)
    fn = backend.compile(model, dynamic_dim=1)
    with torch.no_grad(), backend.capture_session():
        for s in sizes:
            backend.capture_one(ShapeKey(s), lambda s=s: workload.call(fn, static, s), capture_inputs=static)
    try:
        assert backend.num_compilations == 1 and backend.num_piece_compilations == shape.layers + 1
        report = backend.memory_report()
        assert not report.fallbacks and report.resident_output_bytes == max(sizes) * shape.hidden * 2
        workload.refill(static)
        vs_compiled = vs_eager = 0.0
        with torch.no_grad():
            for s in sizes:
                out = backend.replay(ShapeKey(s)).last_hidden_state.clone()
                vs_compiled = max(vs_compiled, max_abs_error(out, workload.call(fn, static, s).last_hidden_state))
                vs_eager = max(vs_eager, max_abs_error(out, workload.call(model, static, s).last_hidden_state))
        _record("piecewise_inductor_llama_bf16", {
            "vs_compiled": vs_compiled, "vs_eager": vs_eager, "compile_s": backend.compile_seconds,
            "inductor_s": backend.inductor_seconds, "bridge_bytes": report.total_bridge_bytes,
        })
        assert vs_compiled == 0.0
        assert vs_eager <= 0.25  # bf16, random weights: Inductor fuses and reorders the math
    finally:
        backend.cleanup()
