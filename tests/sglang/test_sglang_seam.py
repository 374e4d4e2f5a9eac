"""The seam, flag and register() hooks called in-process (the subprocess tests apply them)."""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from cpu_graph_standin import FakeRunner
from sglang_bcg_plugin import BackendRegistrationError, get_plugin_manager, hookimpl

pytestmark = [pytest.mark.sglang, pytest.mark.usefixtures("backend_seam", "cpu_bcg")]


def sglang_bcg(runner: Any, **kw: Any) -> Any:
    from sglang.srt.model_executor.runner_backend.breakable_cuda_graph_backend import BreakableCudaGraphBackend

    return BreakableCudaGraphBackend(runner, **kw)


@pytest.fixture
def select(request: pytest.FixtureRequest) -> Iterator[list[Any]]:
    """A temporary plugin answering ``sglang_bcg_select_backend``; the list collects its calls."""
    calls: list[Any] = []
    answer = request.param if hasattr(request, "param") else None

    class Selector:
        @hookimpl
        def sglang_bcg_select_backend(self, phase: str, server_args: object) -> str | None:
            calls.append((phase, server_args))
            return answer

    pm = get_plugin_manager()
    plugin = pm.register(Selector(), name="test-selector")
    yield calls
    pm.unregister(name=plugin)


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_breakable_becomes_ours_with_same_arguments(phase: str, select: list[Any]) -> None:
    from sglang_bcg_plugin.sglang import sglang_breakable as seam, sglang_breakable_backend_class

    hook = seam.around_resolve_prefill_backend if phase == "prefill" else seam.around_resolve_decode_backend
    runner = FakeRunner()
    calls: list[Any] = []

    def original(r: Any) -> Any:
        calls.append(r)
        return sglang_bcg(r, debug_eager=True)

    backend = hook(original, runner)
    assert calls == [runner]  # SGLang's resolver ran, with the runner
    # private: SGLang keeps its constructor's arguments only there
    assert type(backend) is sglang_breakable_backend_class() and backend._debug_eager is True
    assert backend._cuda_graph_runner is runner
    assert select == [(phase, None)]  # the pluggy hook was consulted for this phase
    assert backend.name == backend.memory_report().backend == "sglang-breakable"  # not the plugin's "breakable"


@pytest.mark.parametrize("select", ["sglang-breakable", "breakable"], indirect=True)
def test_select_keeps_sglangs_class_by_its_name_and_the_old_word_warns_once(
        select: list[Any], request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang_bcg_plugin.sglang import sglang_breakable as seam, sglang_breakable_backend_class

    monkeypatch.setattr(seam, "_warned_breakable", False)
    warns = (pytest.warns(DeprecationWarning, match="return 'sglang-breakable', or None, instead")
             if request.node.callspec.params["select"] == "breakable" else contextlib.nullcontext())
    with warns:
        backend = seam.around_resolve_prefill_backend(lambda r: sglang_bcg(r), FakeRunner())
    assert type(backend) is sglang_breakable_backend_class()
    # once a process: the next selection keeps SGLang's class without a warning (warnings are errors here)
    assert type(seam.around_resolve_decode_backend(lambda r: sglang_bcg(r), FakeRunner())) is type(backend)
    assert [p for p, _ in select] == ["prefill", "decode"]


def test_full_and_other_backends_pass_through(select: list[Any]) -> None:
    from sglang.srt.model_executor.runner_backend.full_cuda_graph_backend import FullCudaGraphBackend

    from sglang_bcg_plugin.sglang import sglang_breakable as seam, sglang_breakable_backend_class

    full = FullCudaGraphBackend(FakeRunner())
    assert seam.around_resolve_decode_backend(lambda r: full, FakeRunner()) is full
    ours = sglang_breakable_backend_class()(FakeRunner())
    assert seam.around_resolve_prefill_backend(lambda r: ours, FakeRunner()) is ours
    assert select == []  # only consulted when SGLang picked its breakable backend


@pytest.mark.parametrize("select", ["full"], indirect=True)
def test_select_routes_to_registered_backend_via_adapter(select: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.model_executor.runner.shape_key import ShapeKey
    from sglang.srt.model_executor.runner_backend.base_cuda_graph_backend import BaseCudaGraphBackend

    from sglang_bcg_plugin.backends.full import FullBackend
    from sglang_bcg_plugin.sglang import sglang_breakable as seam

    monkeypatch.setenv("SGLANG_ENABLE_BCG_SHARED_OUTPUT", "1")
    backend = seam.around_resolve_decode_backend(lambda r: sglang_bcg(r), FakeRunner())
    assert isinstance(backend, BaseCudaGraphBackend) and isinstance(backend.backend, FullBackend)
    import inspect

    x = {n: torch.randn(n, 4) for n in (8, 4)}
    # as the installed release's runners call it: its base class's name for the inputs
    third = list(inspect.signature(BaseCudaGraphBackend.capture_one).parameters)[3]
    with backend.capture_session(None):
        for n in (8, 4):
            backend.capture_one(ShapeKey(n), lambda n=n: x[n] * 3, **{third: None}, post_warmup_hook=None)
    for t in x.values():
        t.add_(1)
    with backend.replay_session():
        out = backend.replay(ShapeKey(4), None)
    torch.testing.assert_close(out, x[4] * 3)
    assert backend.can_run(None, ShapeKey(8)) and not backend.can_run(None, ShapeKey(2))
    report = backend.memory_report()
    assert report.backend == "full" and report.saved_bytes > 0  # the flag (env) reached it
    backend.cleanup()
    assert not backend.can_run(None, ShapeKey(8))


@pytest.mark.parametrize("select", ["full"], indirect=True)
def test_a_routed_backend_follows_the_env_var_the_flag_sets(select: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A routed backend is built with ``BackendOptions()``: its mode is the environment variable's,
    which ``--enable-bcg-shared-output`` writes, with the variable as the reason."""
    from sglang_bcg_plugin.sglang import sglang_breakable as seam

    for raw, mode in (("0", "off"), ("1", "on")):
        monkeypatch.setenv("SGLANG_ENABLE_BCG_SHARED_OUTPUT", raw)
        backend = seam.around_resolve_decode_backend(lambda r: sglang_bcg(r), FakeRunner())
        with backend.capture_session(None):
            assert backend.backend.output_mode_active == mode
        assert backend.backend.last_output_mode.describe() == f"{mode} (SGLANG_ENABLE_BCG_SHARED_OUTPUT={raw!r})"
    assert [p for p, _ in select] == ["decode", "decode"]


def test_select_routes_to_registered_sglang_subclass() -> None:
    from sglang_bcg_plugin.sglang import sglang_breakable as seam, sglang_breakable_backend_class

    class Mine(sglang_breakable_backend_class()):  # type: ignore[misc]
        pass

    class Plugin:
        @hookimpl
        def sglang_bcg_register_backends(self, registry: Any) -> None:
            registry.add("mine", Mine)

        @hookimpl
        def sglang_bcg_select_backend(self, phase: str, server_args: object) -> str | None:
            return "mine" if phase == "prefill" else "nope"

    pm = get_plugin_manager()
    pm.register(Plugin(), name="test-mine")
    try:
        runner = FakeRunner()
        backend = seam.around_resolve_prefill_backend(lambda r: sglang_bcg(r), runner)
        assert type(backend) is Mine and backend._cuda_graph_runner is runner  # private: SGLang's attribute
        with pytest.raises(BackendRegistrationError, match="unknown backend 'nope'"):
            seam.around_resolve_decode_backend(lambda r: sglang_bcg(r), runner)
    finally:
        pm.unregister(name="test-mine")


def test_flag_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang_bcg_plugin.sglang.flag import HELP, after_add_cli_args, after_from_cli_args

    parser = argparse.ArgumentParser()
    after_add_cli_args(None, parser)
    after_add_cli_args(None, parser)  # idempotent on one parser
    assert "SGLANG_ENABLE_BCG_SHARED_OUTPUT" in HELP
    assert parser.parse_args([]).enable_bcg_shared_output is None
    assert parser.parse_args(["--no-enable-bcg-shared-output"]).enable_bcg_shared_output == "off"
    assert parser.parse_args(["--enable-bcg-shared-output=Released"]).enable_bcg_shared_output == "released"
    assert parser.parse_args(["--enable-bcg-shared-output", "1"]).enable_bcg_shared_output == "on"
    with pytest.raises(SystemExit):
        parser.parse_args(["--enable-bcg-shared-output=maybe"])

    class Result:
        pass

    monkeypatch.setenv("SGLANG_ENABLE_BCG_SHARED_OUTPUT", "1")
    result = Result()
    assert after_from_cli_args(result, Result, parser.parse_args([])) is result
    assert os.environ["SGLANG_ENABLE_BCG_SHARED_OUTPUT"] == "1"  # not given: the operator's value stays
    # given: the one carrier, the variable, holds the mode (1, 0 or released); the result is untouched
    for argv, text in ((["--no-enable-bcg-shared-output"], "0"), (["--enable-bcg-shared-output"], "1"),
                       (["--enable-bcg-shared-output=released"], "released")):
        result = Result()
        assert after_from_cli_args(result, Result, parser.parse_args(argv)) is result and not vars(result)
        assert os.environ["SGLANG_ENABLE_BCG_SHARED_OUTPUT"] == text


def test_register_is_idempotent(monkeypatch: pytest.MonkeyPatch) -> None:
    from collections import defaultdict

    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_bcg_plugin.sglang import HOOKS, hooks, register
    from sglang_bcg_plugin.sglang.hooks import wanted

    # private: SGLang's HookRegistry has no public read of what is registered or patched
    monkeypatch.setattr(HookRegistry, "_hooks", defaultdict(list))
    monkeypatch.setattr(hooks, "_registered", False)
    register()
    register()
    assert {t: len(h) for t, h in HookRegistry._hooks.items()} == {t: 1 for t, _, _ in HOOKS if wanted(t)}
    monkeypatch.setattr(hooks, "_registered", False)  # module guard lost: HookRegistry check holds
    register()
    assert all(len(h) == 1 for h in HookRegistry._hooks.values())
    assert HookRegistry._patched.isdisjoint(t for t, _, _ in HOOKS)  # register() only registers
