"""transformers' Qwen2, Gemma, GPT-NeoX and Phi-3 (``tests/test_families.py``) on real CUDA
graphs: every backend in every output mode (Piecewise too), each family in the dtype it ships
in, replay equal to the eager forward after the ids changed in place, twice."""

from __future__ import annotations

import pytest
import torch

from test_families import FAMILIES, family_case

pytestmark = pytest.mark.cuda
DTYPES = {"qwen2": torch.bfloat16, "gemma": torch.bfloat16, "gpt_neox": torch.float16, "phi3": torch.float16}


@pytest.mark.parametrize("mode", ["off", "on", "released"])
@pytest.mark.parametrize("name", ["full", "breakable", "piecewise"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_transformers_family_replays_eager_on_cuda_graphs(family: str, name: str, mode: str) -> None:
    family_case(family, name, mode, device="cuda", engine="cuda", dtype=DTYPES[family])
