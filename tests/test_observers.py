"""Observer hooks that raise (``sglang_bcg_capture_started`` / ``sglang_bcg_capture_finished``).

The rule (docs/reliability.md, docs/hooks.md): a capture is a fact once committed. An observer
that raises in ``sglang_bcg_capture_finished`` is isolated: one ``ObserverWarning`` at the
caller's line names the plugin, the hook and the error, every other observer is still told, and
the key stands and replays (or, when the capture itself failed, its own error propagates). An
observer that raises in ``sglang_bcg_capture_started`` aborts that capture before it began: one
``ObserverError`` names the plugin, nothing is captured and the key can be captured again.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from sglang_bcg_plugin import (
    BackendOptions,
    ObserverError,
    ObserverWarning,
    ShapeKey,
    create_backend,
    get_plugin_manager,
    hookimpl,
)
from sglang_bcg_plugin.manager import reset_plugin_manager
from test_plugins import _write_dist, on_path  # noqa: F401 - the fixture, reused

#: A third-party distribution whose entry point observes captures and raises in one hook.
RAISING = """
    from sglang_bcg_plugin import hookimpl

    SEEN = []

    @hookimpl
    def sglang_bcg_capture_started(backend, shape_key):
        SEEN.append(("started", shape_key))
        if HOOK == "started":
            raise RuntimeError("metrics sink is down")

    @hookimpl
    def sglang_bcg_capture_finished(backend, shape_key, report, error):
        SEEN.append(("finished", shape_key, error))
        if HOOK == "finished":
            raise RuntimeError("metrics sink is down")
"""


class Recorder:
    """A well-behaved observer: what it was told."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, object, object]] = []

    @hookimpl
    def sglang_bcg_capture_started(self, backend: Any, shape_key: Any) -> None:
        self.seen.append(("started", shape_key, None))

    @hookimpl
    def sglang_bcg_capture_finished(self, backend: Any, shape_key: Any, report: Any, error: Any) -> None:
        self.seen.append(("finished", shape_key, report if error is None else error))


@pytest.fixture
def raising_plugin(tmp_path: Path, on_path: Callable[[Path], None]) -> Callable[[str], Any]:  # noqa: F811
    """Install the third-party distribution ``thirdparty-obs`` (entry point ``thirdparty_obs``),
    raising in the given hook; returns its module once the plugin manager loaded it."""

    def install(hook: str) -> Any:
        source = f"HOOK = {hook!r}\n" + textwrap.dedent(RAISING)
        on_path(_write_dist(tmp_path, "thirdparty-obs", "thirdparty_obs", source, "thirdparty_obs"))
        reset_plugin_manager()  # loads the installed entry points again
        pm = get_plugin_manager()
        plugin = pm.get_plugin("thirdparty_obs")
        assert plugin is not None, pm.list_name_plugin()
        return plugin

    return install


def _backend(name: str) -> Any:
    return create_backend(name, options=BackendOptions(engine="eager", output_mode="on"))


@pytest.mark.parametrize("first", [True, False])
@pytest.mark.parametrize("name", ["full", "breakable"])
def test_a_finished_observer_that_raises_is_isolated_and_the_key_stands(
    name: str, first: bool, raising_plugin: Callable[[str], Any]
) -> None:
    plugin = raising_plugin("finished")
    pm = get_plugin_manager()
    good = Recorder()
    if first:  # registered before the third-party plugin: pluggy calls it after it
        pm.unregister(plugin)
        pm.register(good, name="good_observer")
        pm.register(plugin, name="thirdparty_obs")
    else:
        pm.register(good, name="good_observer")
    x = torch.randn(8, 4)
    backend = _backend(name)
    with torch.no_grad(), backend.capture_session():
        with pytest.warns(ObserverWarning) as caught:
            backend.capture_one(ShapeKey(8), lambda: x * 2, capture_inputs=x)
        with pytest.warns(ObserverWarning):
            backend.capture_one(ShapeKey(4), lambda: x[:4] * 2, capture_inputs=x)
    message = str(caught[0].message)
    assert "observer plugin 'thirdparty_obs' raised in sglang_bcg_capture_finished" in message
    assert "ShapeKey(size=8" in message and "RuntimeError: metrics sink is down" in message
    assert "the capture stands and the key replays" in message
    assert caught[0].filename == __file__  # the caller's line
    assert backend.captured_keys() == [ShapeKey(8), ShapeKey(4)]
    x.copy_(torch.randn_like(x))
    for n in (8, 4):
        torch.testing.assert_close(backend.replay(ShapeKey(n)), x[:n] * 2)
    report = backend.memory_report()
    assert good.seen == [
        ("started", ShapeKey(8), None), ("finished", ShapeKey(8), report.keys[0]),
        ("started", ShapeKey(4), None), ("finished", ShapeKey(4), report.keys[1]),
    ]  # the good observer was told every time, before or after the one that raised
    assert [s[:2] for s in plugin.SEEN] == [("started", ShapeKey(8)), ("finished", ShapeKey(8)),
                                            ("started", ShapeKey(4)), ("finished", ShapeKey(4))]
    with pytest.raises(ValueError, match="already captured"):  # it stands: a fact, not a retry
        with backend.capture_session():
            backend.capture_one(ShapeKey(8), lambda: x * 2)


def test_a_finished_observer_that_raises_after_a_failed_capture_keeps_the_captures_error(
    raising_plugin: Callable[[str], Any],
) -> None:
    raising_plugin("finished")
    backend = _backend("full")

    def forward() -> torch.Tensor:
        msg = "forward broke"
        raise ValueError(msg)

    with torch.no_grad(), backend.capture_session():
        with pytest.warns(ObserverWarning, match="the capture's own error propagates"):
            with pytest.raises(ValueError, match="forward broke"):
                backend.capture_one(ShapeKey(4), forward)
        assert backend.captured_keys() == []
        with pytest.warns(ObserverWarning):
            backend.capture_one(ShapeKey(4), lambda: torch.ones(4))  # the retry captures
    assert backend.captured_keys() == [ShapeKey(4)]


@pytest.mark.parametrize("name", ["full", "breakable"])
def test_a_started_observer_that_raises_aborts_the_capture_cleanly(name: str, raising_plugin: Callable[[str], Any]) -> None:
    plugin = raising_plugin("started")
    pm = get_plugin_manager()
    good = Recorder()
    pm.register(good, name="good_observer")
    backend = _backend(name)
    ran: list[int] = []
    with torch.no_grad(), backend.capture_session():
        with pytest.raises(ObserverError) as info:
            backend.capture_one(ShapeKey(4), lambda: ran.append(1) or torch.ones(4))
        assert backend.captured_keys() == [] and ran == []  # no warmup ran
        pm.unregister(plugin)
        backend.capture_one(ShapeKey(4), lambda: torch.ones(4))  # captured again, cleanly
    err = info.value
    assert (err.plugin, err.hook, err.shape_key) == ("thirdparty_obs", "sglang_bcg_capture_started", ShapeKey(4))
    assert isinstance(err.__cause__, RuntimeError) and str(err.__cause__) == "metrics sink is down"
    assert "observer plugin 'thirdparty_obs' raised in sglang_bcg_capture_started" in str(err)
    assert "nothing was captured" in str(err)
    assert isinstance(err, RuntimeError)
    assert good.seen[1] == ("finished", ShapeKey(4), err)  # observers hear the capture failed
    assert len(backend.memory_report().keys) == 1  # the retry only


def test_two_observers_of_one_class_are_told_apart() -> None:
    class Counter:
        def __init__(self, fail: bool) -> None:
            self.fail, self.calls = fail, 0

        @hookimpl
        def sglang_bcg_capture_finished(self, backend: Any, shape_key: Any, report: Any, error: Any) -> None:
            self.calls += 1
            if self.fail:
                msg = "this one"
                raise KeyError(msg)

    pm = get_plugin_manager()
    bad, ok = Counter(fail=True), Counter(fail=False)
    pm.register(ok, name="counter_ok")
    pm.register(bad, name="counter_bad")
    pm.register(Counter(fail=False), name="counter_ok2")
    backend = _backend("full")
    with backend.capture_session(), pytest.warns(ObserverWarning, match=r"'counter_bad' raised .*KeyError: 'this one'") as caught:
        backend.capture_one(ShapeKey(2), lambda: torch.ones(2))
    assert len(caught) == 1
    assert (bad.calls, ok.calls) == (1, 1)


def test_an_interrupt_in_an_observer_is_not_isolated() -> None:
    class Interrupting:
        @hookimpl
        def sglang_bcg_capture_finished(self, backend: Any, shape_key: Any, report: Any, error: Any) -> None:
            raise KeyboardInterrupt

    get_plugin_manager().register(Interrupting(), name="interrupting")
    backend = _backend("full")
    with pytest.raises(KeyboardInterrupt), backend.capture_session():
        backend.capture_one(ShapeKey(2), lambda: torch.ones(2))
    assert backend.captured_keys() == [ShapeKey(2)]  # committed before the observers were told


@pytest.fixture(autouse=True)
def _no_thirdparty_left() -> Iterator[None]:
    yield
    import sys

    sys.modules.pop("thirdparty_obs", None)
