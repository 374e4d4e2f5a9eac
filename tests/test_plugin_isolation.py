"""One broken plugin never takes the others down.

The registry and the observers call each hookimpl on its own (``manager.call_each``: pluggy's
``get_hookimpls()``, no frames walked): a plugin whose ``sglang_bcg_register_backends`` raises, or
whose entry point does not import, is listed as broken (``broken_plugins()``, ``sglang-bcg
backends``, ``doctor``, a ``bench`` note), its backends are dropped with one clear error, and every
other plugin's backends keep working. A registration that ``registry.add`` refuses (a bad name, a
non-callable, a name claimed twice) still raises, as before.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import pluggy
import pytest
import torch

import sglang_bcg_plugin
from sglang_bcg_plugin import (
    BackendOptions,
    BackendRegistrationError,
    ObserverError,
    ObserverWarning,
    PluginLoadWarning,
    ShapeKey,
    available_backends,
    broken_plugins,
    create_backend,
    get_plugin_manager,
    hookimpl,
    hookspecs,
)
from sglang_bcg_plugin.backends.full import FullBackend
from sglang_bcg_plugin.cli import main
from sglang_bcg_plugin.manager import call_each, plugin_origin, reset_plugin_manager
from sglang_bcg_plugin.registry import build_registry
from test_plugins import _write_dist, on_path  # noqa: F401 - the fixture, reused

EAGER = BackendOptions(engine="eager")

#: A healthy third-party distribution: backend ``echo`` from module ``thirdparty_echo``.
ECHO = """
    from sglang_bcg_plugin import hookimpl
    from sglang_bcg_plugin.backends.full import FullBackend

    class EchoBackend(FullBackend):
        name = "echo"

    @hookimpl
    def sglang_bcg_register_backends(registry):
        registry.add("echo", EchoBackend)
"""

#: A distribution whose registration hook adds ``flaky`` and then raises.
FLAKY = """
    from sglang_bcg_plugin import hookimpl
    from sglang_bcg_plugin.backends.breakable import BreakableBackend

    @hookimpl
    def sglang_bcg_register_backends(registry):
        registry.add("flaky", BreakableBackend)
        raise OSError("license server unreachable:\\n  retry later")
"""


@pytest.fixture
def installed(tmp_path: Path, on_path: Callable[[Path], None]) -> Callable[..., None]:  # noqa: F811
    """Install distributions ``(dist, module, source, entry point)`` under one ``site`` on ``sys.path``
    (``source=None``: the entry point names a module that does not exist), then forget the manager."""

    def install(*dists: tuple[str, str, str | None, str]) -> None:
        site = tmp_path / "site"
        for dist, module, source, ep in dists:
            if source is not None:
                _write_dist(tmp_path, dist, module, source, ep)
                continue
            info = site / f"{dist}-3.1.dist-info"
            info.mkdir(parents=True)
            (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 3.1\n")
            (info / "entry_points.txt").write_text(f"[sglang_bcg]\n{ep} = {module}\n")
        on_path(site)
        reset_plugin_manager()

    return install


def test_a_registration_hook_that_raises_breaks_only_its_plugin(installed: Callable[..., None]) -> None:
    installed(("thirdparty-echo", "thirdparty_echo", ECHO, "echo"),
              ("thirdparty-flaky", "thirdparty_flaky", FLAKY, "flaky_plugin"))
    with pytest.warns(PluginLoadWarning) as caught:
        full = create_backend("full", options=EAGER)
    assert len(caught) == 1 and caught[0].filename == __file__  # the user's line
    message = str(caught[0].message)
    assert ("plugin 'flaky_plugin' = thirdparty_flaky (distribution thirdparty-flaky 1.0) raised in "
            "sglang_bcg_register_backends: OSError: license server unreachable: retry later") in message
    assert "SGLANG_BCG_BLOCK_PLUGINS=flaky_plugin" in message and "the others work" in message
    # warned once per plugin manager: every later call is quiet (filterwarnings = error)
    backends = [full] + [create_backend(n, options=EAGER) for n in ("breakable", "piecewise", "echo")]
    assert [b.name for b in backends] == ["full", "breakable", "piecewise", "echo"]
    assert available_backends() == ["breakable", "echo", "full", "piecewise"]  # flaky's add was dropped
    (b,) = broken_plugins()
    assert (b.entry_point, b.value, b.distribution, b.version) == (
        "flaky_plugin", "thirdparty_flaky", "thirdparty-flaky", "1.0")
    assert (b.hook, b.error) == ("sglang_bcg_register_backends", "OSError: license server unreachable: retry later")
    with pytest.raises(BackendRegistrationError) as info:
        create_backend("flaky", options=EAGER)
    assert str(info.value) == (
        "backend 'flaky' is unavailable: plugin 'flaky_plugin' = thirdparty_flaky (distribution thirdparty-flaky "
        "1.0) raised in sglang_bcg_register_backends: OSError: license server unreachable: retry later; fix or "
        "uninstall thirdparty-flaky, or set SGLANG_BCG_BLOCK_PLUGINS=flaky_plugin")


def test_a_name_no_broken_plugin_added_names_the_plugin_of_that_name_or_every_broken_one(installed: Callable[..., None]) -> None:
    raises_first = FLAKY.replace('        registry.add("flaky", BreakableBackend)\n', "")
    installed(("thirdparty-flaky", "thirdparty_flaky", raises_first, "flaky_plugin"),
              ("thirdparty-gone", "thirdparty_gone_module", None, "gone"))
    with pytest.warns(PluginLoadWarning) as caught:
        assert {"breakable", "full", "piecewise"} <= set(available_backends())
    assert sorted(str(w.message).split(" ")[1] for w in caught) == ["'flaky_plugin'", "'gone'"]
    with pytest.raises(BackendRegistrationError) as info:
        create_backend("gone", options=EAGER)  # the broken plugin's own name
    assert str(info.value) == (
        "backend 'gone' is unavailable: plugin 'gone' = thirdparty_gone_module (distribution thirdparty-gone 3.1) "
        "failed to load: ModuleNotFoundError: No module named 'thirdparty_gone_module'; fix or uninstall "
        "thirdparty-gone, or set SGLANG_BCG_BLOCK_PLUGINS=gone")
    with pytest.raises(BackendRegistrationError) as info:
        create_backend("flaky", options=EAGER)  # neither added nor a plugin's name: every broken plugin
    msg = str(info.value)
    assert msg.startswith("unknown backend 'flaky'; available: breakable, full, piecewise; broken plugins, which may "
                          "provide it: plugin 'gone' = thirdparty_gone_module (distribution thirdparty-gone 3.1) "
                          "failed to load: ModuleNotFoundError: No module named 'thirdparty_gone_module'")
    assert "plugin 'flaky_plugin' = thirdparty_flaky" in msg and "SGLANG_BCG_BLOCK_PLUGINS=gone" in msg
    assert [(b.entry_point, b.hook) for b in broken_plugins()] == [
        ("gone", None), ("flaky_plugin", "sglang_bcg_register_backends")]


def test_a_plugin_registered_in_the_process_is_isolated_too() -> None:
    class Mine:
        @hookimpl
        def sglang_bcg_register_backends(self, registry: Any) -> None:
            registry.add("mine", FullBackend)

    class Broken:
        @hookimpl
        def sglang_bcg_register_backends(self, registry: Any) -> None:
            registry.add("half", FullBackend)
            raise KeyError("config")

    pm = get_plugin_manager()
    pm.register(Mine(), name="mine-plugin")
    pm.register(Broken(), name="broken-plugin")
    with pytest.warns(PluginLoadWarning, match=r"plugin 'broken-plugin' \(test_plugin_isolation:.*Broken\) raised"):
        registry = build_registry(pm)
    assert registry.names() == ["breakable", "full", "mine", "piecewise"]
    assert registry.plugin_of("mine") == "mine-plugin"
    assert registry.plugin_of("full") == "sglang_bcg_plugin.backends.full"
    (b,) = registry.broken
    assert (b.distribution, b.error) == ("", "KeyError: 'config'")
    assert b.remedy() == "fix or unregister it, or set SGLANG_BCG_BLOCK_PLUGINS=broken-plugin"
    with pytest.raises(BackendRegistrationError, match="backend 'half' is unavailable: plugin 'broken-plugin'"):
        registry.get("half")
    registry.add("direct", FullBackend)  # outside any hookimpl
    assert registry.plugin_of("direct") == "<direct>"
    pm.unregister(name="broken-plugin")
    assert broken_plugins(pm) == ()  # it is gone, so it is no longer broken


@pytest.mark.parametrize("order", ["refused first", "refused last"])
def test_a_refused_registration_still_raises_beside_a_broken_plugin(order: str) -> None:
    class Raising:
        @hookimpl(tryfirst=order == "refused last")
        def sglang_bcg_register_backends(self, registry: Any) -> None:
            raise RuntimeError("unrelated")

    class NotABackend:
        @hookimpl
        def sglang_bcg_register_backends(self, registry: Any) -> None:
            registry.add("numbers", 42)

    pm = get_plugin_manager()
    pm.register(Raising(), name="raising")
    pm.register(NotABackend(), name="not-a-backend")
    with pytest.warns(PluginLoadWarning, match="'raising'"), pytest.raises(BackendRegistrationError) as info:
        create_backend("full", options=EAGER)
    assert str(info.value) == "plugin 'not-a-backend' registers backend 'numbers' with non-callable 42"
    assert [b.entry_point for b in broken_plugins(pm)] == ["raising"]  # listing the broken never raises


def test_a_refusal_the_plugin_catches_is_its_own_business() -> None:
    class Careful:
        @hookimpl(trylast=True)  # called after the built-ins: "full" is taken
        def sglang_bcg_register_backends(self, registry: Any) -> None:
            try:
                registry.add("full", FullBackend)
            except BackendRegistrationError:
                registry.add("careful_full", FullBackend)

    get_plugin_manager().register(Careful(), name="careful")
    assert "careful_full" in available_backends()


def test_wrappers_run_around_the_implementations_each_attributed() -> None:
    seen: list[str] = []

    class NewStyle:
        @hookimpl(wrapper=True)
        def sglang_bcg_register_backends(self, registry: Any) -> Generator[None, Any, Any]:
            seen.append("new: before")
            result = yield
            seen.append(f"new: after {result!r}, {', '.join(registry.names())}")
            registry.add("wrapped", FullBackend)
            return result

    class OldStyle:
        @hookimpl(hookwrapper=True)
        def sglang_bcg_register_backends(self, registry: Any) -> Generator[None, Any, None]:
            seen.append("old: before")
            outcome = yield
            seen.append(f"old: after {outcome.get_result()!r}")

    class Failing:
        @hookimpl
        def sglang_bcg_register_backends(self, registry: Any) -> None:
            raise ValueError("nope")

    pm = get_plugin_manager()
    pm.register(OldStyle(), name="old")
    pm.register(NewStyle(), name="new")
    pm.register(Failing(), name="failing")
    with pytest.warns(PluginLoadWarning, match="'failing'"):
        registry = build_registry(pm)
    assert seen == ["new: before", "old: before", "old: after []", "new: after [], breakable, full, piecewise"]
    assert registry.plugin_of("wrapped") == "new"


class NoYield:
    @hookimpl(wrapper=True)
    def sglang_bcg_register_backends(self, registry: Any) -> Generator[None, Any, Any]:
        if registry is not None:
            return None
        yield  # pragma: no cover - a generator that returns before its yield


class TwoYields:
    @hookimpl(wrapper=True)
    def sglang_bcg_register_backends(self, registry: Any) -> Generator[None, Any, Any]:
        yield
        yield


class RaisesInSetup:
    @hookimpl(wrapper=True)
    def sglang_bcg_register_backends(self, registry: Any) -> Generator[None, Any, Any]:
        raise LookupError("setup")
        yield  # pragma: no cover - makes it a generator


@pytest.mark.parametrize(("wrapper", "error"), [(NoYield, "did not yield"), (TwoYields, "has a second yield"),
                                                (RaisesInSetup, "LookupError: setup")])
def test_a_wrapper_that_misbehaves_is_isolated(wrapper: type, error: str) -> None:
    pm = get_plugin_manager()
    pm.register(wrapper(), name="odd")
    with pytest.warns(PluginLoadWarning, match=f"plugin 'odd' .* raised in sglang_bcg_register_backends: .*{error}"):
        assert available_backends(pm) == ["breakable", "full", "piecewise"]


def test_call_each_passes_the_arguments_an_implementation_names_and_lets_interrupts_through() -> None:
    pm = pluggy.PluginManager(sglang_bcg_plugin.NAME)
    pm.add_hookspecs(hookspecs)
    got: list[object] = []

    class Partial:
        @hookimpl
        def sglang_bcg_capture_finished(self, shape_key: Any, error: Any = "default") -> object:
            got.append((shape_key, error))
            return "partial's result"

    class Wrapper:
        @hookimpl(wrapper=True)
        def sglang_bcg_capture_finished(self) -> Generator[None, Any, Any]:
            try:
                results = yield
            except GeneratorExit:
                got.append("wrapper closed")
                raise
            got.append(results)
            return results

    class Interrupted:
        @hookimpl(tryfirst=True)
        def sglang_bcg_capture_finished(self) -> None:
            raise KeyboardInterrupt

    pm.register(Partial(), name="partial")
    pm.register(Wrapper(), name="wrapper")
    kwargs = {"backend": None, "shape_key": ShapeKey(2), "report": None, "error": None}
    assert call_each(pm.hook.sglang_bcg_capture_finished, kwargs) == []
    assert got == [(ShapeKey(2), None), ["partial's result"]]  # the defaulted argument too; the wrapper sees results
    pm.register(Interrupted(), name="interrupted")
    got.clear()
    with pytest.raises(KeyboardInterrupt):
        call_each(pm.hook.sglang_bcg_capture_finished, kwargs)
    assert got == ["wrapper closed"]  # the interrupt ran first, stopped the call, and the wrapper was closed


def test_a_plugin_module_registered_in_the_process_is_named_by_its_module(tmp_path: Path) -> None:
    import types

    module = types.ModuleType("inprocess_plugin")
    exec(textwrap.dedent("""
        def sglang_bcg_register_backends(registry):
            raise RuntimeError("module-level")
    """), module.__dict__)
    module.sglang_bcg_register_backends = hookimpl(module.sglang_bcg_register_backends)
    pm = get_plugin_manager()
    pm.register(module, name="inproc")
    with pytest.warns(PluginLoadWarning, match=r"plugin 'inproc' \(inprocess_plugin\) raised"):
        (b,) = broken_plugins(pm)
    assert (b.value, b.distribution, b.error) == ("inprocess_plugin", "", "RuntimeError: module-level")
    assert plugin_origin(pm, "never-registered") == ("never-registered", "", "")


def test_observers_of_one_hook_fail_one_by_one() -> None:
    told: list[str] = []

    def observer(name: str, fail: bool) -> object:
        class Observer:
            @hookimpl
            def sglang_bcg_capture_started(self, backend: Any, shape_key: Any) -> None:
                told.append(f"{name} started")

            @hookimpl
            def sglang_bcg_capture_finished(self, backend: Any, shape_key: Any, report: Any, error: Any) -> None:
                told.append(f"{name} finished")
                if fail:
                    raise ZeroDivisionError(name)

        return Observer()

    pm = get_plugin_manager()
    for name, fail in (("a", True), ("b", False), ("c", True)):
        pm.register(observer(name, fail), name=name)
    backend = create_backend("full", options=EAGER)
    with backend.capture_session(), pytest.warns(ObserverWarning) as caught:
        backend.capture_one(ShapeKey(2), lambda: torch.ones(2))
    assert told == ["c started", "b started", "a started", "c finished", "b finished", "a finished"]
    assert [str(w.message).split(" ")[2] for w in caught] == ["'c'", "'a'"]  # one warning each, in call order

    class Refusing:
        @hookimpl(tryfirst=True)
        def sglang_bcg_capture_started(self, backend: Any, shape_key: Any) -> None:
            raise PermissionError("quota")

    told.clear()
    pm.register(Refusing(), name="refusing")
    with backend.capture_session(), pytest.raises(ObserverError) as info, pytest.warns(ObserverWarning):
        backend.capture_one(ShapeKey(1), lambda: torch.ones(1))
    assert info.value.plugin == "refusing" and isinstance(info.value.__cause__, PermissionError)
    assert told == ["c finished", "b finished", "a finished"]  # no one else heard it start


def test_backends_command_shows_modules_and_broken_plugins(
    installed: Callable[..., None], capsys: pytest.CaptureFixture[str]
) -> None:
    installed(("thirdparty-echo", "thirdparty_echo", ECHO, "echo"),
              ("thirdparty-flaky", "thirdparty_flaky", FLAKY, "flaky_plugin"),
              ("thirdparty-gone", "thirdparty_gone_module", None, "gone"))
    assert main(["backends"]) == 1  # no warning either (filterwarnings = error): printed as lines
    assert capsys.readouterr().out.splitlines() == [
        "breakable\tsglang_bcg_plugin.backends.breakable",
        "echo\tthirdparty_echo",  # the module, as for the built-ins, not the plugin's name twice
        "full\tsglang_bcg_plugin.backends.full",
        "piecewise\tsglang_bcg_plugin.backends.piecewise",
        "BROKEN gone (thirdparty-gone 3.1): ModuleNotFoundError: No module named 'thirdparty_gone_module'",
        "BROKEN flaky_plugin (thirdparty-flaky 1.0) in sglang_bcg_register_backends: OSError: license server "
        "unreachable: retry later",
    ]


def test_bench_runs_the_healthy_backends_beside_a_broken_plugin(
    installed: Callable[..., None], capsys: pytest.CaptureFixture[str]
) -> None:
    installed(("thirdparty-echo", "thirdparty_echo", ECHO, "echo"),
              ("thirdparty-flaky", "thirdparty_flaky", FLAKY, "flaky_plugin"))
    tiny = ["--max-tokens", "8", "--hidden", "16", "--layers", "1", "--repeats", "1", "--variants", "off",
            "--no-progress"]
    assert main(["bench", "--backends", "full,echo", *tiny]) == 0
    out, err = capsys.readouterr()
    assert "  full/off done in" in err and "  echo/off done in" in err  # a row each, the third-party one too
    firsts = [line.split()[0] for line in out.splitlines() if line.strip()]
    assert [b for b in firsts if b in ("full", "echo")] == ["full", "echo"]
    assert ("note: plugin 'flaky_plugin' = thirdparty_flaky (distribution thirdparty-flaky 1.0) raised in "
            "sglang_bcg_register_backends: OSError: license server unreachable: retry later; its backends are not "
            "available") in err
    assert main(["bench", "--backends", "flaky", *tiny]) == 2
    err = capsys.readouterr().err
    note, error = err.splitlines()  # the note says why 'flaky' is unknown, before the error line
    assert note.startswith("note: plugin 'flaky_plugin'")
    assert error.startswith("error: unknown backends") and "flaky" in error


def test_doctor_lists_the_backends_and_the_broken_plugins(installed: Callable[..., None]) -> None:
    from sglang_bcg_plugin.integration.doctor import backend_lines

    assert backend_lines() == (["  breakable\tsglang_bcg_plugin.backends.breakable",
                                "  full\tsglang_bcg_plugin.backends.full",
                                "  piecewise\tsglang_bcg_plugin.backends.piecewise"], None)
    installed(("thirdparty-flaky", "thirdparty_flaky", FLAKY, "flaky_plugin"))
    lines, summary = backend_lines()
    assert lines[-1].startswith("  BROKEN flaky_plugin (thirdparty-flaky 1.0) in sglang_bcg_register_backends")
    assert summary == ("doctor: 1 sglang_bcg plugin(s) broken: their backends cannot be selected, the others work "
                       "(see the BROKEN lines)")
    get_plugin_manager().register(type("Dup", (), {"sglang_bcg_register_backends": hookimpl(
        lambda self, registry: registry.add("full", FullBackend))})(), name="dup")
    lines, summary = backend_lines()
    assert lines[0].startswith("  [REFUSED] backend name 'full' is claimed by two plugins")
    assert summary is not None and "refuses a registration" in summary


def test_the_plugin_machinery_walks_no_frames() -> None:
    """Who failed is known because each implementation is called on its own: no frame is read
    (the one frame walk left, ``errors.user_stacklevel``, points a warning at the user's line)."""
    root = Path(sglang_bcg_plugin.__file__).parent
    for module in ("manager.py", "registry.py"):
        tree = ast.parse((root / module).read_text())
        names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        names |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        frame_apis = {"_getframe", "currentframe", "f_back", "f_locals", "stack", "walk_stack", "walk_tb",
                      "subset_hook_caller", "traceback"}
        assert names & frame_apis == set(), module
