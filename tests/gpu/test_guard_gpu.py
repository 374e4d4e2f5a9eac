"""The stale-output guard with torch's real storage poisoning (CUDA builds only)."""

from __future__ import annotations

import pytest
import torch

from sglang_bcg_plugin import BackendOptions, ShapeKey, create_backend
from sglang_bcg_plugin.output.guard import guard_supported

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("name", ["breakable", "full"])
def test_stale_view_raises_naming_both_keys(name: str) -> None:
    assert guard_supported()
    backend = create_backend(name, options=BackendOptions(output_mode="on", engine="cuda", stale_output_guard=True))
    xs = {s: torch.randn(s, 64, device="cuda") for s in (256, 128)}
    with backend.capture_session():
        for s, x in xs.items():
            backend.capture_one(ShapeKey(s), lambda x=x: x * 2, capture_inputs=x)
    a = backend.replay(ShapeKey(256))
    torch.testing.assert_close(a, xs[256] * 2)
    b = backend.replay(ShapeKey(128))
    torch.testing.assert_close(b, xs[128] * 2)
    with pytest.raises(RuntimeError, match=r"stale output.*ShapeKey\(size=256.*ShapeKey\(size=128"):
        a.sum()
    a2 = backend.replay(ShapeKey(256))  # a new replay hands out a fresh, valid view
    torch.testing.assert_close(a2, xs[256] * 2)
