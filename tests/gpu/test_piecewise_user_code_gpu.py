"""The cases of ``tests/test_piecewise_user_code.py`` on an H200: real CUDA graphs, and the eager
engine over CUDA tensors. A ``@graph_break`` attention compiled by Piecewise (traced through:
on CUDA it is captured inside the piece's graph) and the same model under Full and Breakable;
fixed-size tensor arguments beside the sized ones in every ``dynamic`` mode."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from test_piecewise_user_code import (
    DYNAMIC,
    MODES,
    _quiet,
    batch_first_case,
    fixed_scale_case,
    mixed_args_case,
    readme_model_case,
    rows_per_size_case,
)

pytestmark = pytest.mark.cuda
ENGINES = ["cuda", "eager"]


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["piecewise", "full", "breakable"])
def test_readme_model_gpu(name: str, mode: Any, split: bool, engine: str) -> None:
    readme_model_case(name, mode, "cuda", engine, split=split)


@pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores")  # Inductor's advice on fp32 matmuls
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("mode", MODES)
def test_readme_model_inductor_gpu(mode: Any, engine: str) -> None:
    readme_model_case("piecewise", mode, "cuda", engine, inductor=True)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dynamic", DYNAMIC)
def test_fixed_scale_gpu(dynamic: str, mode: Any, engine: str) -> None:
    fixed_scale_case(dynamic, mode, "cuda", engine)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dynamic", DYNAMIC)
def test_batch_first_gpu(dynamic: str, mode: Any, engine: str) -> None:
    batch_first_case(dynamic, mode, "cuda", engine)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dynamic", DYNAMIC)
def test_mixed_args_gpu(dynamic: str, mode: Any, engine: str) -> None:
    _quiet(mixed_args_case, dynamic, mode, "cuda", engine)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dynamic", DYNAMIC)
def test_rows_per_size_gpu(dynamic: str, mode: Any, engine: str) -> None:
    rows_per_size_case(dynamic, mode, "cuda", engine)
