from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from sglang_bcg_plugin.manager import reset_plugin_manager

#: Set by ``.ci/run``, which runs the releases' ``tests/sglang`` beside the main run: a lock file
#: every run's tests hold shared, and an ``alone`` test alone (its timing failed under load).
CI_LOCK = os.environ.get("SGLANG_BCG_CI_LOCK")


@contextlib.contextmanager
def ci_lock(alone: bool) -> Iterator[None]:
    """Hold ``CI_LOCK`` shared, or alone; a test waiting to run alone holds the gate, so no other
    test starts meanwhile (POSIX locks: a forked child does not inherit them)."""
    with open(f"{CI_LOCK}.gate", "a+") as gate, open(str(CI_LOCK), "a+") as lock:
        fcntl.lockf(gate, fcntl.LOCK_EX)
        if not alone:
            fcntl.lockf(gate, fcntl.LOCK_UN)
        fcntl.lockf(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        yield


@pytest.hookimpl(wrapper=True)
def pytest_collection(session: pytest.Session) -> Any:
    if CI_LOCK is None:
        return (yield)
    with ci_lock(alone=False):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    if CI_LOCK is None:
        return (yield)
    with ci_lock(alone=item.get_closest_marker("alone") is not None):
        return (yield)


@pytest.fixture(autouse=True)
def fresh_plugin_manager(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test gets a freshly built plugin manager and a clean sharing env var."""
    monkeypatch.delenv("SGLANG_ENABLE_BCG_SHARED_OUTPUT", raising=False)
    monkeypatch.delenv("SGLANG_BCG_BLOCK_PLUGINS", raising=False)
    reset_plugin_manager()
    yield
    reset_plugin_manager()


@pytest.fixture(params=["breakable", "full"])
def backend_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)
