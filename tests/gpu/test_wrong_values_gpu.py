"""The wrong-value cases of ``tests/test_wrong_values.py`` on an H200: real CUDA graphs, and the
eager engine over CUDA tensors, so both engines are held to what a caller sees."""

from __future__ import annotations

from typing import Any

import pytest

from test_wrong_values import (
    MODES,
    SOURCES,
    around_breaks_case,
    piecewise_prologue_case,
    run_quietly,
    user_view_case,
)

pytestmark = pytest.mark.cuda
ENGINES = ["cuda", "eager"]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("warmups", [0, 2])
@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["full", "breakable"])
def test_user_view_gpu(name: str, mode: Any, source: str, warmups: int, engine: str) -> None:
    run_quietly(user_view_case, name, mode, source, warmups, "cuda", engine)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("mode", MODES)
def test_around_breaks_gpu(mode: Any, engine: str) -> None:
    around_breaks_case(mode, "cuda", engine)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("mode", MODES)
def test_piecewise_prologue_gpu(mode: Any, engine: str) -> None:
    piecewise_prologue_case(mode, "cuda", engine)
