"""``gc_safe_capture`` and ``defer_release``: collect before, GC disabled during, graph owners
dropped inside a capture park their graphs until it ends, the frozen generation untouched."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterator

import pytest

from sglang_bcg_plugin.engines.cuda import FullCudaEngine, FullGraph
from sglang_bcg_plugin.engines.gcsafe import capture_in_progress, defer_release, gc_safe_capture, parked_count
from sglang_bcg_plugin.engines.cuda_segments import CudaSegments


class Node:
    """Cyclic garbage with a weak reference to tell when the collector freed it."""

    def __init__(self) -> None:
        self.me = self


class Graph:
    """Stands in for a ``torch.cuda.CUDAGraph`` (no CUDA here): named, to tell which one parked."""

    def __init__(self, name: str) -> None:
        self.name = name


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


def test_without_collect_the_gc_is_off_and_nested_entries_do_not_collect() -> None:
    """``collect=False`` (the forecast's probes): garbage waits, the GC is off, a nested entry
    (the backend's own session) does not collect; the next outermost entry does."""
    gc.enable()
    gc.collect()
    ref = _cycle()
    with gc_safe_capture(collect=False):
        assert not gc.isenabled() and capture_in_progress()
        with gc_safe_capture():
            assert ref() is not None  # no collection: the cycle is still there
        assert ref() is not None
    assert gc.isenabled()
    with gc_safe_capture():
        assert ref() is None


def _owners() -> list[tuple[object, weakref.ref[Graph]]]:
    """Each real graph owner (CUDA classes built without CUDA) holding one stand-in graph."""
    g1, g2, g3, g4 = Graph("full"), Graph("segment"), Graph("open segment"), Graph("anchor")
    full = FullGraph(g1, None)  # type: ignore[arg-type]
    segments = CudaSegments(pool=None)
    segments.graphs.append(g2)  # type: ignore[arg-type]
    # private: only a real CUDA capture opens a segment or anchors a pool; the stand-ins set both
    segments._current = g3  # type: ignore[assignment]  # a capture was open when it was dropped
    engine = FullCudaEngine()
    engine._anchors.append(g4)  # type: ignore[arg-type]
    return [(full, weakref.ref(g1)), (segments, weakref.ref(g2)), (segments, weakref.ref(g3)), (engine, weakref.ref(g4))]


def test_graph_owners_dropped_inside_a_capture_park_their_graphs_until_it_ends() -> None:
    from sglang_bcg_plugin.engines import gcsafe

    owners = _owners()
    for owner, _ in owners:
        owner.cycle = owner  # type: ignore[attr-defined]  # only the cyclic GC frees it
    holder = [o for o, _ in owners]
    owner_refs = [weakref.ref(o) for o in holder]
    del owners, owner
    with gc_safe_capture():
        holder.clear()
        gc.collect()  # what a forward, or an automatic collection, might do inside a capture
        assert all(r() is None for r in owner_refs)  # the owners are gone ...
        # ... their graphs are not destroyed: parked (the GC clears weak references to objects it
        # found unreachable even when a finalizer resurrects them, so look at the parking lot)
        # private: parked_count() is the public read; which graphs are parked is not public
        assert sorted(g.name for g in gcsafe._parked) == ["anchor", "full", "open segment", "segment"]
    assert parked_count() == 0  # destroyed after the last capture ended


def test_outside_a_capture_graphs_go_with_their_owner() -> None:
    owners = _owners()
    refs = [r for _, r in owners]
    del owners
    assert all(r() is None for r in refs) and parked_count() == 0


def test_defer_release_never_raises() -> None:
    class Broken:
        def __iter__(self) -> Iterator[object]:
            raise RuntimeError("boom")

    with gc_safe_capture():
        defer_release(Broken())  # type: ignore[arg-type]
    assert parked_count() == 0


def test_nested_only_outermost_restores() -> None:
    gc.enable()
    with gc_safe_capture():
        with gc_safe_capture():
            assert not gc.isenabled()
        assert not gc.isenabled() and capture_in_progress()
    assert gc.isenabled() and not capture_in_progress()


def test_exception_restores_state() -> None:
    gc.enable()
    with pytest.raises(RuntimeError, match="boom"), gc_safe_capture():
        raise RuntimeError("boom")
    assert gc.isenabled() and not capture_in_progress()


def test_someone_elses_freeze_is_left_exactly_as_it_was() -> None:
    """Freezing cannot be undone selectively; we never freeze, so a backend made after someone
    else's ``gc.freeze()`` (SGLang's ``freeze_gc``) is still freed by the collector."""
    gc.freeze()
    frozen = gc.get_freeze_count()
    ref = _cycle()  # made after their freeze
    with gc_safe_capture():
        assert ref() is None and not gc.isenabled()
    # Never frozen further, never unfrozen (that would empty the permanent generation); a frozen
    # object freed by reference counting meanwhile leaves it, so the count may drop by a few.
    assert frozen // 2 < gc.get_freeze_count() <= frozen and gc.isenabled()


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
    assert gc.isenabled() and not capture_in_progress()


def test_backend_dropped_in_a_cycle_without_cleanup_is_freed(backend_name: str) -> None:
    """No error: the backend goes when the collector runs, even inside a capture."""
    import torch

    from sglang_bcg_plugin import BackendOptions, ShapeKey, create_backend

    backend = create_backend(backend_name, options=BackendOptions(output_mode="on", engine="eager"))
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
        assert ref() is None
