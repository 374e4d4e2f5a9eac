"""``gc_safe_capture``: collect before, freeze and disable during, restore exactly after."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterator

import pytest

from sglang_bcg_plugin.engines.gcsafe import capture_in_progress, gc_safe_capture


class Node:
    """Cyclic garbage with a weak reference to tell when the collector freed it."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture(autouse=True)
def gc_state() -> Iterator[None]:
    was = gc.isenabled()
    gc.unfreeze()
    yield
    gc.unfreeze()
    if was:
        gc.enable()
    else:
        gc.disable()


def _cycle() -> weakref.ref[Node]:
    return weakref.ref(Node())


def test_collects_before_and_restores_enabled_state() -> None:
    for enabled in (True, False):
        gc.enable() if enabled else gc.disable()
        ref = _cycle()
        with gc_safe_capture():
            assert ref() is None  # garbage died before the capture
            assert not gc.isenabled() and capture_in_progress()
        assert gc.isenabled() is enabled and not capture_in_progress()
        assert gc.get_freeze_count() == 0


def test_explicit_collect_inside_cannot_free_older_garbage() -> None:
    holder = [Node()]
    ref = weakref.ref(holder[0])
    with gc_safe_capture():
        assert gc.get_freeze_count() > 0
        holder.clear()  # unreachable only now, inside the capture
        gc.collect()
        assert ref() is not None  # frozen: a destructor never runs inside the capture
    gc.collect()
    assert ref() is None  # released normally afterwards


def test_nested_only_outermost_restores() -> None:
    gc.enable()
    with gc_safe_capture():
        with gc_safe_capture():
            assert not gc.isenabled()
        assert not gc.isenabled() and capture_in_progress() and gc.get_freeze_count() > 0
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_exception_restores_state() -> None:
    gc.enable()
    with pytest.raises(RuntimeError, match="boom"), gc_safe_capture():
        raise RuntimeError("boom")
    assert gc.isenabled() and gc.get_freeze_count() == 0 and not capture_in_progress()


def test_someone_elses_freeze_is_left_alone() -> None:
    gc.freeze()  # e.g. SGLang's freeze_gc around its capture loop
    frozen = gc.get_freeze_count()
    assert frozen > 0
    with gc_safe_capture():
        assert not gc.isenabled()
    assert gc.get_freeze_count() >= frozen  # not unfrozen by us
    assert gc.isenabled()


def test_objects_made_after_someone_elses_freeze_are_protected_too() -> None:
    """Their freeze does not cover a cycle made later; ours must (the H200 GC test failed when
    the freeze was skipped because something else had frozen first)."""
    gc.freeze()
    died: list[str] = []

    class Graphs:
        def __del__(self) -> None:
            died.append("graphs")

    g = Graphs()
    g.cycle = g  # type: ignore[attr-defined]
    holder = [g]
    del g
    with gc_safe_capture():
        holder.clear()
        gc.collect()  # what a forward (or an automatic collection) might do inside a capture
        assert died == []
    gc.unfreeze()  # the other party's unfreeze, later
    gc.collect()
    assert died == ["graphs"]


def test_threads_share_one_depth() -> None:
    gc.enable()
    inside, release = threading.Event(), threading.Event()

    def other() -> None:
        with gc_safe_capture():
            inside.set()
            release.wait(10)

    t = threading.Thread(target=other)
    with gc_safe_capture():
        t.start()
        assert inside.wait(10)
    assert not gc.isenabled() and capture_in_progress()  # the other thread still captures
    release.set()
    t.join(10)
    assert gc.isenabled() and not capture_in_progress() and gc.get_freeze_count() == 0


def test_backend_dropped_in_a_cycle_without_cleanup_is_freed(backend_name: str) -> None:
    """No finalizer, no error: the graphs go when Python frees the backend (outside captures)."""
    import torch

    from sglang_bcg_plugin import BackendOptions, ShapeKey, create_backend

    backend = create_backend(backend_name, options=BackendOptions(share_output=True, engine="eager"))
    x = torch.randn(8, 4)
    with backend.capture_session():
        for n in (8, 4):
            backend.capture_one(ShapeKey(n), lambda n=n: x[:n] * 2, capture_inputs=x)
    backend.cycle = backend  # type: ignore[attr-defined]
    ref = weakref.ref(backend)
    holder = [backend]
    del backend
    with gc_safe_capture():
        holder.clear()  # garbage only now, inside a "capture"
        gc.collect()
        assert ref() is not None  # its destructors never run inside a capture
    gc.collect()
    assert ref() is None  # freed afterwards, without error
