"""Detecting what the installed SGLang's built-in BCG does with outputs (our default inside SGLang)."""

from __future__ import annotations

import sys

import pytest

from sglang_bcg_plugin.sglang import compat as builtin
from sglang_bcg_plugin.sglang.compat import BuiltinPolicy, inspect_builtin
from sglang_bcg_plugin.sglang.compat import sglang_builtin_policy

pytestmark = pytest.mark.sglang


#: What each release's own breakable graph does (read from the wheels), as the probe must find it.
EXPECTED = {
    "0.5.13": (False, "BreakableCudaGraphRunner._capture_all keeps one output_buffers entry per size"),
    "0.5.14": (True, "BreakableCudaGraphBackend.capture_one adopts the first capture's output"),
    "0.5.15": (True, "BreakableCudaGraphBackend.capture_one adopts the first capture's output"),
    **{
        f"0.5.{n}": (True, "BreakableCudaGraphBackend.capture_one always copies outputs into one _shared_output_buffer")
        for n in range(16, 24)
    },
}


def test_installed_sglang_default_is_its_own_behaviour() -> None:
    import importlib.metadata

    shares, reason = EXPECTED[importlib.metadata.version("sglang")]
    policy = sglang_builtin_policy()
    assert policy.shares is shares and policy.default_mode == ("on" if shares else "off")
    assert policy.default_reason().startswith(f"default: {policy.default_mode}, the installed SGLang's own behaviour: {reason}")


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
    assert inspect_builtin(sourceless).shares is None and "cannot read Sourceless's code" in inspect_builtin(sourceless).reason


def test_sglang_that_does_not_import_means_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang_bcg_plugin.sglang import compat

    compat.installed.cache_clear()
    for name in (compat.BACKEND_MODULE, compat.RUNNER_MODULE):
        monkeypatch.setitem(sys.modules, name, None)
    try:
        policy = sglang_builtin_policy()
        assert policy.shares is None and policy.reason.startswith("SGLang's breakable graph does not import")
        assert builtin.sglang_builtin_policy().shares is None
    finally:
        compat.installed.cache_clear()


def test_runner_policies() -> None:
    from sglang_bcg_plugin.sglang.compat import inspect_runner

    class Sharing:
        def _capture_all(self) -> None:
            self._shared_output_buffer = None

    assert inspect_runner(Sharing).shares is None
    assert inspect_runner(type("NoSource", (), {})).shares is None
