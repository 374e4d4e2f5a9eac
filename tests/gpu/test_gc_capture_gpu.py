"""Cyclic GC during a capture (run on the H200; skipped without CUDA).

Backend A is captured, then dropped without ``cleanup()`` while it sits in a reference cycle, so
only the cyclic garbage collector can free its graphs. Backend B's forward calls ``gc.collect()``
while its stream is capturing. Without ``engines.gcsafe.gc_safe_capture`` A's graph destructors
ran inside B's capture ("operation not permitted when stream is capturing (function reset)",
then ``CUBLAS_STATUS_INTERNAL_ERROR`` / ``cudaErrorStreamCaptureInvalidated``).

Two moments for the drop: before B's session (the collection before each capture frees A
outside the capture) and inside B's capture (A dies there; its graph owners park the graphs,
``engines.gcsafe.defer_release``, and they are destroyed when B's capture ends). The GC's frozen
generation is never touched: on the H200 something has frozen objects before the first test, and
an earlier version that froze again left A frozen for good.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from sglang_bcg_plugin import BackendOptions, ShapeKey, create_backend, graph_break
from sglang_bcg_plugin.engines.gcsafe import parked_count

from splitting_ops import mix  # tests/splitting_ops.py

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the H200 machine)"),
]

H = 256
SIZES = [256, 128, 64]  # largest first


@graph_break(reads=("x",))
def eager_mix(x: torch.Tensor) -> torch.Tensor:
    """Break point of the breakable backend (same math as ``mix``)."""
    return torch.tanh(x) + 1.0


class Net(torch.nn.Module):
    def __init__(self, name: str) -> None:
        super().__init__()
        g = torch.Generator(device="cpu").manual_seed(0)
        self.register_buffer("w", (torch.randn(2, H, H, generator=g) / H**0.5).cuda())
        self.name = name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.w[0]
        if self.name == "piecewise":
            h = mix(h)
        elif self.name == "breakable":
            h = eager_mix(h)
        else:
            h = torch.tanh(h) + 1.0
        return torch.relu(h @ self.w[1]) + x


class Setup:
    """One backend, its (compiled) model and static inputs; ``hook`` runs before each forward."""

    def __init__(self, name: str, hook: Callable[[], None] = lambda: None) -> None:
        kwargs: dict[str, Any] = {"splitting_ops": [mix]} if name == "piecewise" else {}
        self.backend = create_backend(name, options=BackendOptions(output_mode="on", engine="cuda"), **kwargs)
        self.model = Net(name)
        self.fn = self.backend.compile(self.model) if name == "piecewise" else self.model  # type: ignore[attr-defined]
        self.x = torch.randn(max(SIZES), H, device="cuda")
        self.hook = hook

    def forward(self, size: int) -> Callable[[], Any]:
        x = self.x[:size]

        def run() -> Any:
            self.hook()
            return self.fn(x)

        return run

    def capture(self) -> None:
        with torch.no_grad(), self.backend.capture_session():
            for s in SIZES:
                self.backend.capture_one(ShapeKey(s), self.forward(s), capture_inputs=self.x)


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    gc.collect()


def _cyclic_garbage_backend(name: str) -> tuple[list[Any], weakref.ref[Any]]:
    """Backend A, captured, in a reference cycle, reachable only through the returned list."""
    a = Setup(name)
    a.capture()
    torch.cuda.synchronize()
    a.backend.cycle = a  # type: ignore[attr-defined]  # backend -> Setup -> backend: only the GC frees it
    return [a], weakref.ref(a.backend)


@pytest.mark.parametrize("when", ["before_session", "inside_capture"])
@pytest.mark.parametrize("name", ["full", "breakable", "piecewise"])
def test_dropped_backend_collected_around_another_capture(name: str, when: str) -> None:
    holder, ref_a = _cyclic_garbage_backend(name)
    collections = {"inside": 0}

    def collect_while_capturing() -> None:
        if torch.cuda.is_current_stream_capturing():
            holder.clear()  # "inside_capture": A becomes garbage only now
            gc.collect()
            collections["inside"] += 1

    if when == "before_session":
        holder.clear()
    b = Setup(name, hook=collect_while_capturing)
    b.capture()
    torch.cuda.synchronize()
    assert collections["inside"] >= len(SIZES)  # the forward really collected inside captures
    assert parked_count() == 0  # graphs parked during B's captures were destroyed after them
    torch._dynamo.reset()  # compiled code of A's model must not keep anything of A alive
    gc.collect()  # A's graphs are released here at the latest, outside any capture, without error
    torch.cuda.synchronize()
    assert ref_a() is None
    b.hook = lambda: None
    with torch.no_grad():
        b.x.copy_(torch.randn_like(b.x))  # inputs change in place
        for s in SIZES:
            got = b.backend.replay(ShapeKey(s)).clone()
            torch.testing.assert_close(got, b.model(b.x[:s].clone()), rtol=1e-4, atol=1e-4)
    b.backend.cleanup()
