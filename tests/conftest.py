from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from sglang_bcg_plugin.manager import reset_plugin_manager


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
