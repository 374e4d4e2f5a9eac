"""Backend contract: sessions, errors, cleanup, the switch between sessions."""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import pytest
import torch

from _support import make_backend
from sglang_bcg_plugin import BackendOptions, CaptureStateError, ShapeKey, create_backend


def test_capture_outside_session_is_an_error(backend_name: str) -> None:
    backend = make_backend(backend_name, share=True)
    with pytest.raises(CaptureStateError, match="capture_session"):
        backend.capture_one(ShapeKey(4), lambda: torch.zeros(4))


def test_sessions_do_not_nest(backend_name: str) -> None:
    backend = make_backend(backend_name, share=True)
    with backend.capture_session(), pytest.raises(CaptureStateError, match="do not nest"):
        with backend.capture_session():
            pass  # pragma: no cover
    assert backend.output_mode_active is None


def test_replay_unknown_key_names_key_and_sizes(backend_name: str) -> None:
    backend = make_backend(backend_name, share=False)
    with backend.capture_session():
        for s in (8, 4):
            backend.capture_one(ShapeKey(s), lambda s=s: torch.ones(s))
    with pytest.raises(KeyError) as info:
        backend.replay(ShapeKey(16))
    assert "ShapeKey(size=16" in str(info.value) and "[4, 8]" in str(info.value)
    assert backend.can_run(ShapeKey(8)) and not backend.can_run(ShapeKey(16))
    assert backend.can_run(ShapeKey(4)) and not backend.can_run(ShapeKey(4, 0))


def test_double_capture_and_bad_forward(backend_name: str) -> None:
    backend = make_backend(backend_name, share=False)
    with backend.capture_session():
        backend.capture_one(ShapeKey(4), lambda: torch.ones(4))
        with pytest.raises(ValueError, match="already captured"):
            backend.capture_one(ShapeKey(4), lambda: torch.ones(4))
        with pytest.raises(TypeError, match="forward_fn must be callable"):
            backend.capture_one(ShapeKey(2), None)  # type: ignore[arg-type]


def test_warmups_hook_and_capture_inputs_kept_alive(backend_name: str) -> None:
    backend = create_backend(backend_name, options=BackendOptions(engine="eager", num_warmups=3))
    calls: list[str] = []

    class Inputs:
        def __init__(self) -> None:
            self.x = torch.randn(4)

    inputs = Inputs()
    ref = weakref.ref(inputs)

    def forward() -> torch.Tensor:
        calls.append("fwd")
        return inputs.x * 2

    with backend.capture_session():
        backend.capture_one(ShapeKey(4), forward, capture_inputs=[inputs], post_warmup_hook=lambda: calls.append("hook"))
    assert calls == ["fwd", "hook"] * 3 + ["fwd"]
    del inputs
    assert ref() is not None  # held with the graph
    backend.cleanup()
    assert ref() is None


def test_toggle_between_sessions_and_old_graphs_keep_working(backend_name: str) -> None:
    backend = make_backend(backend_name, share=False)
    x8, x4 = torch.randn(8, 3), torch.randn(4, 3)
    with backend.capture_session():
        assert backend.output_mode_active == "off"
        backend.capture_one(ShapeKey(8), lambda: x8 * 2)
        backend.capture_one(ShapeKey(4), lambda: x4 * 2)
    backend.configure(output_mode="on")
    assert backend.options.output_mode == "on"
    with backend.capture_session():
        assert backend.output_mode_active == "on"
        backend.capture_one(ShapeKey(8, 1), lambda: x8 * 3)
        backend.capture_one(ShapeKey(4, 1), lambda: x4 * 3)
    x8.copy_(torch.randn_like(x8))
    x4.copy_(torch.randn_like(x4))
    torch.testing.assert_close(backend.replay(ShapeKey(8)), x8 * 2, rtol=0, atol=0)
    torch.testing.assert_close(backend.replay(ShapeKey(4)), x4 * 2, rtol=0, atol=0)
    torch.testing.assert_close(backend.replay(ShapeKey(8, 1)), x8 * 3, rtol=0, atol=0)
    torch.testing.assert_close(backend.replay(ShapeKey(4, 1)), x4 * 3, rtol=0, atol=0)
    keys = {k.key: k for k in backend.memory_report().keys}
    assert not keys[ShapeKey(4)].shared and keys[ShapeKey(4, 1)].shared
    assert keys[ShapeKey(4, 1)].resident_output_bytes == 0


def test_none_option_follows_env_at_each_session(backend_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = make_backend(backend_name, share=None)  # type: ignore[arg-type]
    monkeypatch.setenv("SGLANG_ENABLE_BCG_SHARED_OUTPUT", "1")
    with backend.capture_session():
        assert backend.output_mode_active == "on"
    monkeypatch.setenv("SGLANG_ENABLE_BCG_SHARED_OUTPUT", "off")
    with backend.capture_session():
        assert backend.output_mode_active == "off"
    monkeypatch.setenv("SGLANG_ENABLE_BCG_SHARED_OUTPUT", "bogus")
    with pytest.raises(ValueError, match="SGLANG_ENABLE_BCG_SHARED_OUTPUT"), backend.capture_session():
        pass  # pragma: no cover


def test_output_mode_keyword_takes_a_resolution(backend_name: str) -> None:
    from sglang_bcg_plugin.output.mode import Resolution

    with pytest.raises(TypeError, match=r"output_mode= takes a Resolution .*give a mode as options=BackendOptions\(output_mode=\.\.\.\)"):
        create_backend(backend_name, output_mode="on")
    backend = create_backend(backend_name, options=BackendOptions(engine="eager"), output_mode=Resolution("released", "mine"))
    assert backend.last_output_mode is None  # before the first session
    with backend.capture_session():
        assert backend.output_mode_active == "released"
    assert backend.last_output_mode == Resolution("released", "mine")
    backend.configure(output_mode="off")  # an explicit option still wins
    with backend.capture_session():
        assert backend.output_mode_active == "off"


def test_cleanup_then_recapture(backend_name: str) -> None:
    backend = make_backend(backend_name, share=True)
    x = torch.randn(4, 2)
    for _ in range(3):
        with backend.capture_session():
            backend.capture_one(ShapeKey(4), lambda: x + 1)
        torch.testing.assert_close(backend.replay(ShapeKey(4)), x + 1)
        backend.cleanup()
        assert backend.captured_keys() == []
    with backend.capture_session(), pytest.raises(CaptureStateError, match="cleanup"):
        backend.cleanup()


def test_sglang_style_four_field_keys_are_distinct(backend_name: str) -> None:
    @dataclasses.dataclass(frozen=True)
    class SGLangShapeKey:
        size: int
        stream_idx: int | None = None
        variant_label: str | None = None
        attention_variant: str | None = None

    backend = make_backend(backend_name, share=True)
    x = torch.randn(4, 2)
    with backend.capture_session():
        backend.capture_one(SGLangShapeKey(4, attention_variant="mha"), lambda: x + 1)
        backend.capture_one(SGLangShapeKey(4, attention_variant="mla"), lambda: x + 2)
    torch.testing.assert_close(backend.replay(SGLangShapeKey(4, attention_variant="mha")), x + 1)
    torch.testing.assert_close(backend.replay(SGLangShapeKey(4, attention_variant="mla")), x + 2)


def test_engine_cuda_without_cuda_is_a_clear_error(backend_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    backend = create_backend(backend_name, options=BackendOptions(engine="cuda"))
    with pytest.raises(RuntimeError, match="CUDA is not available"), backend.capture_session():
        pass  # pragma: no cover
    backend = create_backend(backend_name)
    assert backend.engine_name == "eager"


def test_configure_engine_resets_unused_engine(backend_name: str) -> None:
    backend = make_backend(backend_name, share=False)
    assert backend.engine_name == "eager"
    backend.configure(engine="eager", strict_outputs=True)
    assert backend.engine_name == "eager" and backend.options.strict_outputs
    if not torch.cuda.is_available():
        # nothing captured: the eager engine is dropped, so the next one follows the new option
        backend.configure(engine="cuda")
        with pytest.raises(RuntimeError, match="engine='cuda' but CUDA is not available"):
            _ = backend.engine_name


def test_eager_replay_detects_changed_structure() -> None:
    """Full's eager engine re-runs the forward at replay: a changed structure or shape is refused."""
    backend = make_backend("full", share=False)
    state: dict[str, Any] = {"tuple": True, "rows": 4}

    def forward() -> Any:
        t = torch.ones(state["rows"])
        return (t, t) if state["tuple"] else [t, t]

    with backend.capture_session():
        backend.capture_one(ShapeKey(4), forward)
    state["tuple"] = False
    with pytest.raises(RuntimeError, match="another structure"):
        backend.replay(ShapeKey(4))
    state["tuple"], state["rows"] = True, 5
    with pytest.raises(RuntimeError, match="shape"):
        backend.replay(ShapeKey(4))


def test_eager_segments_replay_what_was_captured() -> None:
    """Breakable's eager segments replay the recorded ops, as a CUDA graph replays its kernels:
    the forward's Python does not run again, so a changed Python branch changes nothing."""
    backend = make_backend("breakable", share=False)
    state: dict[str, Any] = {"scale": 2.0, "calls": 0}
    x = torch.randn(4)

    def forward() -> Any:
        state["calls"] += 1
        return (x * state["scale"], x + 1)

    with backend.capture_session():
        backend.capture_one(ShapeKey(4), forward)
    calls = state["calls"]
    state["scale"] = 3.0
    x.copy_(torch.randn(4))
    out = backend.replay(ShapeKey(4))
    assert state["calls"] == calls
    torch.testing.assert_close(out[0], x * 2.0)
    torch.testing.assert_close(out[1], x + 1)


def test_memory_report_format_and_dict(backend_name: str) -> None:
    backend = make_backend(backend_name, share=True)
    xs = {s: torch.randn(s, 2) for s in (8, 4)}
    with backend.capture_session():
        backend.capture_one(ShapeKey(8), lambda: xs[8] * 1)
        with pytest.warns(UserWarning):
            backend.capture_one(ShapeKey(4), lambda: xs[4].double())
    report = backend.memory_report()
    text = report.format()
    assert f"{backend_name} backend (eager engine): 2 keys" in text and "fallback ShapeKey(size=4" in text
    d = report.to_dict()
    assert d["saved_bytes"] == report.saved_bytes == 0
    assert d["keys"][1]["fallback"].startswith("output: dtype changed")
    assert d["fallbacks"] == {repr(ShapeKey(4)): report.fallbacks[ShapeKey(4)]}
