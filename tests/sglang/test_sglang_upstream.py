"""The installed release's own ``capture_one`` runs under our backend, and still fits our wrap.

Our SGLang backend copies none of SGLang's capture code (``sglang/sglang_breakable.py``):
it calls the release's ``capture_one`` with a forward and a post-warmup hook of ours and
overrides the output helpers that ``capture_one`` calls. These tests fail, naming what changed,
when a release's ``capture_one`` stops fitting that: a new private helper (it may keep an output
of SGLang's own next to ours), an overridden helper no longer reached through our class.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.sglang, pytest.mark.usefixtures("backend_seam")]


def _sglang_class() -> Any:
    from sglang.srt.model_executor.runner_backend.breakable_cuda_graph_backend import BreakableCudaGraphBackend

    return BreakableCudaGraphBackend


def test_capture_one_uses_only_helpers_we_know() -> None:
    import importlib.metadata

    from sglang_bcg_plugin.sglang.sglang_breakable import INTERCEPTED, NEUTRAL, unknown_capture_helpers

    unknown = unknown_capture_helpers(_sglang_class().capture_one)
    assert not unknown, (
        f"SGLang {importlib.metadata.version('sglang')}'s BreakableCudaGraphBackend.capture_one now uses {unknown}: "
        f"review it and list each name in sglang_breakable.INTERCEPTED (an output helper, overridden) or NEUTRAL "
        f"(holds no output); known: {INTERCEPTED + NEUTRAL}"
    )


def test_every_helper_the_release_calls_is_ours() -> None:
    from sglang_bcg_plugin.sglang import sglang_breakable_backend_class
    from sglang_bcg_plugin.sglang.compat import code_names
    from sglang_bcg_plugin.sglang.sglang_breakable import INTERCEPTED, SharingPolicyMixin

    used = code_names(_sglang_class().capture_one) or frozenset()
    ours = sglang_breakable_backend_class()
    assert {"_shared_output_buffer", "_copy_output_to_buffer", "_slice_output"} <= used  # every release 0.5.14+
    for name in INTERCEPTED:
        assert ours.__dict__.get(name, getattr(ours, name)) is SharingPolicyMixin.__dict__[name], name


@pytest.mark.usefixtures("cpu_bcg")
@pytest.mark.parametrize("debug_eager", [False, True])
def test_the_releases_capture_one_runs_and_makes_no_buffer(monkeypatch: pytest.MonkeyPatch, debug_eager: bool) -> None:
    from cpu_graph_standin import FakeRunner

    from sglang_bcg_plugin.sglang import sglang_breakable_backend_class
    from sglang.srt.model_executor.runner.shape_key import ShapeKey

    cls, calls = _sglang_class(), []
    original = cls.capture_one

    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(args[0].size)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, "capture_one", spy)
    monkeypatch.setenv("SGLANG_ENABLE_BCG_SHARED_OUTPUT", "1")
    backend = sglang_breakable_backend_class()(FakeRunner(), debug_eager=debug_eager)
    x = {n: torch.randn(n, 4) for n in (8, 4)}
    with backend.capture_session(None):
        for n in (8, 4):
            backend.capture_one(ShapeKey(size=n, stream_idx=None), lambda n=n: x[n] * 2)
    assert calls == [8, 4]
    assert backend._shared_output_buffer is None  # private: SGLang's own buffer, never made
    for n in (8, 4):
        x[n].copy_(torch.randn(n, 4))
        with backend.replay_session():
            torch.testing.assert_close(backend.replay(ShapeKey(size=n, stream_idx=None), None), x[n] * 2, rtol=0, atol=0)
    assert backend.memory_report().resident_output_bytes == 8 * 4 * 4  # one shared buffer
