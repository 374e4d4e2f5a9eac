"""The release probes and refusals of the SGLang integration, on stand-in classes (no SGLang needed)."""

from __future__ import annotations

import contextvars
import sys
import types
from typing import Any

import pytest

from sglang_bcg_plugin.sglang import compat
from sglang_bcg_plugin.sglang.compat import BuiltinPolicy
from sglang_bcg_plugin.sglang.compat import Seam
from sglang_bcg_plugin.sglang.sglang_session import refusal

ON = BuiltinPolicy(True, "shares")


def seam(kind: str, **kw: Any) -> Seam:
    return Seam(kind, "0.5.99", "stand-in", ON, **kw)  # type: ignore[arg-type]


def test_refusals_name_the_release_and_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    assert refusal(seam("backend"), "released", True, {}) is None
    none = refusal(seam("none"), "on", False, {})
    assert none is not None and none.startswith("SGLang 0.5.99 has no breakable CUDA graph") and "\n" not in none
    guard = refusal(seam("runner"), "off", True, {})
    assert guard is not None and "SGLang 0.5.99's BreakableCudaGraphRunner.replay" in guard
    monkeypatch.setattr(compat, "pool_borrowing_exists", lambda: True)
    from sglang_bcg_plugin.sglang import sglang_session

    monkeypatch.setattr(sglang_session, "pool_borrowing_exists", lambda: True)
    borrow = refusal(seam("backend"), "released", False, {"SGLANG_ENABLE_GRAPH_POOL_BORROW": "1"})
    assert borrow is not None and "borrow_graph_pool" in borrow
    monkeypatch.setattr(sglang_session, "released_supported", lambda: False)
    assert "lacks" in (refusal(seam("backend"), "released", False, {}) or "")


def test_startup_refusal_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from sglang_bcg_plugin.sglang import flag

    def refuse_unsupported() -> None:  # the flag's AFTER hook, the flag not given
        assert flag.after_from_cli_args("result", object, argparse.Namespace()) == "result"

    monkeypatch.setattr(compat, "installed", lambda: seam("runner"))
    monkeypatch.delenv("SGLANG_ENABLE_BCG_SHARED_OUTPUT", raising=False)
    monkeypatch.delenv("SGLANG_BCG_STALE_OUTPUT_GUARD", raising=False)
    refuse_unsupported()  # nothing asked: the release's default always runs
    monkeypatch.setenv("SGLANG_BCG_STALE_OUTPUT_GUARD", "1")
    with pytest.raises(SystemExit, match=r"^sglang_bcg: SGLANG_BCG_STALE_OUTPUT_GUARD=1 needs replays"):
        refuse_unsupported()
    monkeypatch.setenv("SGLANG_BCG_STALE_OUTPUT_GUARD", "maybe")
    with pytest.raises(SystemExit, match="is not a boolean"):
        refuse_unsupported()
    monkeypatch.delenv("SGLANG_BCG_STALE_OUTPUT_GUARD")
    monkeypatch.setenv("SGLANG_ENABLE_BCG_SHARED_OUTPUT", "on")

    def broken() -> Seam:
        raise ImportError("no sglang here")

    monkeypatch.setattr(compat, "installed", broken)
    refuse_unsupported()  # cannot probe: doctor's job, startup goes on
    monkeypatch.setenv("SGLANG_ENABLE_BCG_SHARED_OUTPUT", "maybe")
    with pytest.raises(SystemExit, match="^sglang_bcg: SGLANG_ENABLE_BCG_SHARED_OUTPUT='maybe' is not an output mode"):
        refuse_unsupported()  # an invalid value stops the launch, probe or not


def test_eager_break_forms_and_capture_var() -> None:
    calls: list[Any] = []
    module = types.ModuleType("bcg_standin")

    def eager_on_graph(first: Any = None) -> Any:
        calls.append(first)
        return first if callable(first) else (lambda fn: fn)

    module.eager_on_graph = eager_on_graph  # type: ignore[attr-defined]
    fn = lambda: 1  # noqa: E731
    assert compat.eager_break(module, fn, "enable") is fn and calls == [True]
    assert compat.eager_break(module, fn, "fn") is fn and calls == [True, fn]

    var: contextvars.ContextVar[Any] = contextvars.ContextVar("capture", default="capturing")
    capture_module = types.ModuleType("bcg_capture_standin")
    capture_module._current_capture_var = var  # type: ignore[attr-defined]  # private: SGLang's name, on a stand-in module
    Capture = type("Capture", (), {"__module__": "bcg_capture_standin"})
    sys.modules["bcg_capture_standin"] = capture_module
    try:
        assert compat.run_outside_capture(Capture, var.get) is None and var.get() == "capturing"
    finally:
        del sys.modules["bcg_capture_standin"]


def test_small_probes() -> None:
    assert compat.num_segments(types.SimpleNamespace(_segments=[1, 2])) == 2
    assert compat.num_segments(object()) == 1
    runner = types.SimpleNamespace(cuda_graph_output_rows=lambda out: 3)
    assert compat.runner_rows(runner, None) == (3, None)
    assert compat.runner_rows(object(), None) == (None, None)
    assert seam("none").describe() == "SGLang 0.5.99: no breakable CUDA graph seam (stand-in)"
    assert tuple(seam("backend").features()) == compat.FEATURES


def test_seam_kind_without_sglang(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compat.importlib.util, "find_spec", lambda name: None)
    assert compat.seam_kind() == "none"


def test_checks_per_seam_kind() -> None:
    from sglang_bcg_plugin.sglang.doctor import seam_checks

    assert seam_checks(seam("none")) == []
    labels = [label for label, _ in seam_checks(seam("runner"))]
    assert len(labels) == 5
    assert any("_capture_one runs self._run_forward inside BreakableCUDAGraphCapture" in label for label in labels)


def test_runner_policy_reads_the_class() -> None:
    from sglang_bcg_plugin.sglang.compat import inspect_runner

    class KeepsOne:
        def _capture_all(self) -> None:
            self.output_buffers: dict[int, object] = {}

    policy = inspect_runner(KeepsOne)
    assert policy.shares is False and policy.reason.endswith("KeepsOne._capture_all keeps one output_buffers entry per size")
