"""Pluggy: built-ins through the public hook, third-party entry points, capture hook."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import pluggy
import pytest
import torch

import sglang_bcg_plugin as sbp
from sglang_bcg_plugin import (
    BackendOptions,
    BackendRegistrationError,
    ShapeKey,
    available_backends,
    create_backend,
    get_plugin_manager,
    hookimpl,
)
from sglang_bcg_plugin.backends.full import FullBackend
from sglang_bcg_plugin.manager import reset_plugin_manager
from sglang_bcg_plugin.registry import build_registry


def _write_dist(tmp_path: Path, dist: str, module: str, source: str, ep_name: str) -> Path:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / f"{module}.py").write_text(textwrap.dedent(source))
    info = site / f"{dist}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[sglang_bcg]\n{ep_name} = {module}\n")
    return site


@pytest.fixture
def on_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Path], None]]:
    added: list[str] = []

    def add(path: Path) -> None:
        monkeypatch.syspath_prepend(str(path))
        added.append(str(path))

    yield add
    for mod in [m for m in sys.modules if m.startswith("thirdparty_")]:
        del sys.modules[mod]


THIRD_PARTY = """
    from sglang_bcg_plugin import hookimpl
    from sglang_bcg_plugin.backends.full import FullBackend

    class EchoBackend(FullBackend):
        name = "echo"

    @hookimpl
    def sglang_bcg_register_backends(registry):
        registry.add("echo", EchoBackend)
"""


def test_builtins_registered_through_the_public_hook() -> None:
    pm = get_plugin_manager()
    plugins = {impl.plugin_name for impl in pm.hook.sglang_bcg_register_backends.get_hookimpls()}
    assert {
        "sglang_bcg_plugin.backends.full",
        "sglang_bcg_plugin.backends.breakable",
        "sglang_bcg_plugin.backends.piecewise",
    } <= plugins
    assert {"breakable", "full", "piecewise"} <= set(available_backends())


def test_manager_is_cached_and_lazy() -> None:
    import sglang_bcg_plugin.manager as manager

    assert get_plugin_manager() is get_plugin_manager()
    reset_plugin_manager()
    # private: no public "is a manager loaded" read; laziness is the fact tested
    assert manager._manager is None  # nothing is loaded until asked for
    pm = get_plugin_manager()
    assert manager._manager is pm
    assert pm.project_name == sbp.NAME == "sglang_bcg"


def test_third_party_distribution_backend(tmp_path: Path, on_path: Callable[[Path], None]) -> None:
    on_path(_write_dist(tmp_path, "thirdparty-echo", "thirdparty_echo", THIRD_PARTY, "echo"))
    reset_plugin_manager()
    assert "echo" in available_backends()
    backend = create_backend("echo", options=BackendOptions(engine="eager"))
    assert type(backend).__name__ == "EchoBackend"
    dists = {d.metadata["Name"] for _, d in get_plugin_manager().list_plugin_distributions()}
    assert "thirdparty-echo" in dists


def test_blocked_plugin_is_not_loaded(tmp_path: Path, on_path: Callable[[Path], None], monkeypatch: pytest.MonkeyPatch) -> None:
    on_path(_write_dist(tmp_path, "thirdparty-echo", "thirdparty_echo", THIRD_PARTY, "echo"))
    monkeypatch.setenv("SGLANG_BCG_BLOCK_PLUGINS", "echo, ")
    reset_plugin_manager()
    assert "echo" not in available_backends()


def test_duplicate_name_names_both_plugins(tmp_path: Path, on_path: Callable[[Path], None]) -> None:
    src = """
        from sglang_bcg_plugin import hookimpl
        from sglang_bcg_plugin.backends.full import FullBackend

        class Impostor(FullBackend):
            pass

        @hookimpl
        def sglang_bcg_register_backends(registry):
            registry.add("full", Impostor)
    """
    on_path(_write_dist(tmp_path, "thirdparty-dup", "thirdparty_dup", src, "impostor"))
    reset_plugin_manager()
    with pytest.raises(BackendRegistrationError) as info:
        available_backends()
    msg = str(info.value)
    assert "'full'" in msg and "sglang_bcg_plugin.backends.full" in msg and "'impostor'" in msg
    assert "Impostor" in msg and "FullBackend" in msg


def test_unknown_backend_lists_available() -> None:
    with pytest.raises(BackendRegistrationError, match="available: breakable, full, piecewise"):
        create_backend("nope")
    assert issubclass(BackendRegistrationError, ValueError)


@pytest.mark.parametrize(("name", "factory", "match"), [("bad name", FullBackend, "identifier"), ("x", 3, "non-callable")])
def test_bad_registrations(name: str, factory: Any, match: str) -> None:
    class Bad:
        @hookimpl
        def sglang_bcg_register_backends(self, registry: Any) -> None:
            registry.add(name, factory)

    pm = get_plugin_manager()
    pm.register(Bad(), name="bad")
    with pytest.raises(BackendRegistrationError, match=match) as info:
        available_backends()
    assert "'bad'" in str(info.value)


def test_observers_see_every_capture(backend_name: str) -> None:
    seen: list[tuple[str, object, object]] = []

    class Observer:
        @hookimpl
        def sglang_bcg_capture_started(self, backend: Any, shape_key: Any) -> None:
            seen.append(("started", shape_key, backend.name))

        @hookimpl
        def sglang_bcg_capture_finished(self, backend: Any, shape_key: Any, report: Any, error: Any) -> None:
            seen.append(("finished", shape_key, report if error is None else error))

    get_plugin_manager().register(Observer(), name="observer")
    backend = create_backend(backend_name, options=BackendOptions(engine="eager"))
    x = torch.randn(4, 3)
    with backend.capture_session():
        out = backend.capture_one(ShapeKey(4), lambda: x * 2)
    torch.testing.assert_close(out, x * 2)
    report = backend.memory_report()
    assert seen == [("started", ShapeKey(4), backend_name), ("finished", ShapeKey(4), report.keys[0])]
    assert report.capture_seconds[ShapeKey(4)] > 0
    assert report.keys[0].graph_memory_bytes is None  # eager engine: no device memory


def test_capture_needs_no_plugin(backend_name: str) -> None:
    """The capture is the backend's own: with a plugin manager holding no plugin at all it
    captures, replays and accounts as usual."""
    from sglang_bcg_plugin import hookspecs
    from sglang_bcg_plugin.backends.breakable import BreakableBackend
    from sglang_bcg_plugin.backends.full import FullBackend

    empty = pluggy.PluginManager("sglang_bcg")
    empty.add_hookspecs(hookspecs)
    assert empty.get_plugins() == set()
    cls = {"breakable": BreakableBackend, "full": FullBackend}[backend_name]
    backend = cls(options=BackendOptions(engine="eager"), plugin_manager=empty)
    x = torch.randn(4, 3)
    with backend.capture_session():
        backend.capture_one(ShapeKey(4), lambda: x * 2)
    x.copy_(torch.randn(4, 3))
    torch.testing.assert_close(backend.replay(ShapeKey(4)), x * 2)
    assert backend.memory_report().capture_seconds[ShapeKey(4)] > 0


def test_an_observer_that_raises_aborts_the_capture(backend_name: str) -> None:
    class Refuser:
        @hookimpl
        def sglang_bcg_capture_started(self, backend: Any, shape_key: Any) -> None:
            msg = "not this one"
            raise RuntimeError(msg)

    pm = get_plugin_manager()
    refuser = Refuser()
    pm.register(refuser, name="refuser")
    backend = create_backend(backend_name, options=BackendOptions(engine="eager"))
    with backend.capture_session():
        with pytest.raises(RuntimeError, match="not this one"):
            backend.capture_one(ShapeKey(4), lambda: torch.zeros(4))
        assert backend.captured_keys() == []
        pm.unregister(refuser)
        backend.capture_one(ShapeKey(4), lambda: torch.zeros(4))  # still usable
    assert backend.captured_keys() == [ShapeKey(4)]


def _write_ep(tmp_path: Path, dist: str, ep_line: str) -> Path:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    info = site / f"{dist}-2.5.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 2.5\n")
    (info / "entry_points.txt").write_text(f"[sglang_bcg]\n{ep_line}\n")
    return site


def test_plugin_that_fails_to_import_is_reported_and_builtins_work(
    tmp_path: Path, on_path: Callable[[Path], None]
) -> None:
    from sglang_bcg_plugin import PluginLoadWarning, broken_plugins

    on_path(_write_ep(tmp_path, "thirdparty-broken", "broken = thirdparty_missing_module"))
    reset_plugin_manager()
    with pytest.warns(PluginLoadWarning) as caught:
        names = available_backends()
    msg = str(caught[0].message)
    assert "'broken' = thirdparty_missing_module (distribution thirdparty-broken 2.5)" in msg
    assert "ModuleNotFoundError" in msg and "SGLANG_BCG_BLOCK_PLUGINS=broken" in msg
    assert {"breakable", "full", "piecewise"} <= set(names)
    (b,) = broken_plugins()
    assert (b.entry_point, b.distribution, b.version) == ("broken", "thirdparty-broken", "2.5")
    assert b.error.startswith("ModuleNotFoundError: No module named 'thirdparty_missing_module'")
    backend = create_backend("full", options=BackendOptions(engine="eager"))  # built-ins still work
    assert backend.name == "full"


def test_plugin_that_fails_to_register_is_unregistered(tmp_path: Path, on_path: Callable[[Path], None]) -> None:
    from sglang_bcg_plugin import PluginLoadWarning, broken_plugins

    src = """
        from sglang_bcg_plugin import hookimpl

        @hookimpl
        def sglang_bcg_register_backends(registry, not_a_hook_argument):
            raise AssertionError("never called")
    """
    on_path(_write_dist(tmp_path, "thirdparty-badsig", "thirdparty_badsig", src, "badsig"))
    reset_plugin_manager()
    with pytest.warns(PluginLoadWarning, match="'badsig'.*thirdparty-badsig 1.0.*PluginValidationError"):
        pm = get_plugin_manager()
    assert not pm.has_plugin("badsig")
    assert [b.entry_point for b in broken_plugins(pm)] == ["badsig"]
    assert "full" in available_backends(pm)


def test_backends_command_lists_broken_plugins(
    tmp_path: Path, on_path: Callable[[Path], None], capsys: pytest.CaptureFixture[str]
) -> None:
    from sglang_bcg_plugin.cli import main

    on_path(_write_ep(tmp_path, "thirdparty-broken", "broken = thirdparty_missing_module:plugin"))
    reset_plugin_manager()
    assert main(["backends"]) == 1
    out = capsys.readouterr().out
    assert "full\tsglang_bcg_plugin.backends.full" in out
    assert "BROKEN broken (thirdparty-broken 2.5): ModuleNotFoundError: No module named 'thirdparty_missing_module'" in out


def test_broken_plugins_of_a_plain_pluggy_manager_is_empty() -> None:
    import pluggy

    from sglang_bcg_plugin import broken_plugins

    assert broken_plugins(pluggy.PluginManager(sbp.NAME)) == ()
    assert broken_plugins() == ()


def test_registration_calls_each_hookimpl_with_the_wrappers_around() -> None:
    """Each hookimpl of ``sglang_bcg_register_backends`` is called on its own, a wrapper around them
    all, and each ``add`` is told apart by the plugin whose hookimpl made it."""
    seen: list[str] = []

    class Wrapper:
        @hookimpl(wrapper=True)
        def sglang_bcg_register_backends(self, registry: Any) -> Any:
            seen.append("before")
            result = yield
            seen.append(f"after: {', '.join(registry.names())}")
            return result

    class Mine:
        @hookimpl
        def sglang_bcg_register_backends(self, registry: Any) -> None:
            registry.add("mine", FullBackend)

    pm = get_plugin_manager()
    pm.register(Wrapper(), name="wrapper")
    pm.register(Mine(), name="mine-plugin")
    registry = build_registry(pm)
    assert seen == ["before", "after: breakable, full, mine, piecewise"]
    assert registry.plugin_of("mine") == "mine-plugin" and registry.plugin_of("full") == "sglang_bcg_plugin.backends.full"
    registry.add("direct", FullBackend)  # not from a hookimpl
    assert registry.plugin_of("direct") == "<direct>"
