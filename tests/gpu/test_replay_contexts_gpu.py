"""The cases of ``tests/test_replay_contexts.py`` on an H200: real CUDA graphs, and the eager
engine over CUDA tensors, so both engines are held to what a caller sees (a capture under
``torch.inference_mode()`` replayed outside it, broadcast outputs)."""

from __future__ import annotations

import pytest

from test_replay_contexts import (
    BROADCAST_CASES,
    MODES,
    NAMES,
    PAIRS,
    SOURCES,
    broadcast_case,
    mixed_partition_case,
    replay_context_case,
)

pytestmark = pytest.mark.cuda
ENGINES = ["cuda", "eager"]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("capture_ctx", "replay_ctx"), PAIRS)
@pytest.mark.parametrize("name", NAMES)
def test_replay_in_another_autograd_context_gpu(name: str, capture_ctx: str, replay_ctx: str, mode: str, engine: str) -> None:
    replay_context_case(name, mode, capture_ctx, replay_ctx, "cuda", engine)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("first", ["inference", "no_grad"])
@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("name", ["full", "breakable"])
def test_a_partition_captured_in_two_modes_gpu(name: str, source: str, first: str, engine: str) -> None:
    mixed_partition_case(name, source, first, "cuda", engine)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("name", "kind"), BROADCAST_CASES)
def test_a_broadcast_output_replays_the_eager_values_gpu(name: str, kind: str, mode: str, source: str, engine: str) -> None:
    broadcast_case(name, kind, mode, source, "cuda", engine)
