"""Detecting what the installed SGLang's built-in BCG does with outputs (our default inside SGLang)."""

from __future__ import annotations

import sys

import pytest

from sglang_bcg_plugin.integration import builtin
from sglang_bcg_plugin.integration.builtin import BuiltinPolicy, inspect_builtin, sglang_builtin_policy, sglang_builtin_shares

pytestmark = pytest.mark.sglang


def test_installed_sglang_0_5_23_always_shares() -> None:
    policy = sglang_builtin_policy()
    assert sglang_builtin_shares() is True and policy.default_mode == "on"
    assert policy.default_reason() == (
        "default: on, the installed SGLang's own behaviour: "
        "BreakableCudaGraphBackend.capture_one always copies outputs into one _shared_output_buffer"
    )


class KeepsOwn:
    def __init__(self) -> None:
        self._outputs: dict[object, object] = {}

    def capture_one(self, key: object) -> None:
        self._outputs[key] = None


class Switched:
    def __init__(self) -> None:
        self._shared_output_buffer = None

    def capture_one(self, key: object) -> None:
        if self.server_args.share_output:  # type: ignore[attr-defined]
            self._shared_output_buffer = self._alloc_full_buffer()  # type: ignore[attr-defined]
            self._copy_output_to_buffer()  # type: ignore[attr-defined]


def test_other_policies_are_off_with_a_reason() -> None:
    keeps = inspect_builtin(KeepsOwn)
    assert keeps == BuiltinPolicy(False, "KeepsOwn.capture_one keeps one output per shape key") and keeps.default_mode == "off"
    switched = inspect_builtin(Switched)
    assert switched.shares is None and "under a switch (share_output)" in switched.reason
    sourceless = type("Sourceless", (), {"capture_one": print, "__init__": object.__init__})
    assert inspect_builtin(sourceless).shares is None and "cannot read Sourceless's source" in inspect_builtin(sourceless).reason


def test_sglang_that_does_not_import_means_off(monkeypatch: pytest.MonkeyPatch) -> None:
    sglang_builtin_policy.cache_clear()
    monkeypatch.setitem(sys.modules, "sglang.srt.model_executor.runner_backend.breakable_cuda_graph_backend", None)
    try:
        policy = sglang_builtin_policy()
        assert policy.shares is None and policy.reason.startswith("SGLang's breakable backend does not import")
        assert builtin.sglang_builtin_shares() is None
    finally:
        sglang_builtin_policy.cache_clear()
