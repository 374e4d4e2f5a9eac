"""The host-read and output-attribute cases of ``tests/test_host_reads.py`` on an H200: real CUDA
graphs, and the eager engine over CUDA tensors.

On real CUDA graphs a host read inside a capture fails in torch/CUDA (a host sync inside a
stream capture); our CUDA engines turn it into the same :class:`HostReadError` (key, segment),
roll the key back and stay usable: each case captures the same key again without the read and
checks its replay. transformers' stock ``"sdpa"`` sees a real stream capture and builds its mask
on the device, so there it replays the mask's new values.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from test_host_reads import (
    KINDS,
    MODES,
    PROPERTY,
    READS,
    break_read_case,
    extra_attribute_case,
    host_read_case,
    llama_4d_mask_case,
    llama_sdpa_mask_case,
    quietly,
    replay_property,
)

pytestmark = pytest.mark.cuda
ENGINES = ["cuda", "eager"]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("read", READS)
@pytest.mark.parametrize("name", ["breakable", "full"])
def test_host_read_refused_gpu(name: str, read: str, engine: str) -> None:
    host_read_case(name, read, "before", "on", "cuda", engine)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("read", ["item", "if", "tolist"])
def test_host_read_after_a_break_gpu(read: str, mode: str, engine: str) -> None:
    host_read_case("breakable", read, "after", mode, "cuda", engine)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("where", ["before", "after"])
@pytest.mark.parametrize("read", ["item", "nonzero"])
def test_piecewise_host_read_gpu(read: str, where: str, engine: str) -> None:
    host_read_case("piecewise", read, where, "on", "cuda", engine)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("mode", MODES)
def test_break_read_gpu(mode: str, engine: str) -> None:
    break_read_case(mode, "cuda", engine)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("mode", ["off", "on"])
@pytest.mark.parametrize("mask_kind", ["2d", "none"])
def test_llama_stock_sdpa_gpu(mask_kind: str, mode: str, engine: str) -> None:
    llama_sdpa_mask_case(mask_kind, mode, "cuda", engine)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("mode", ["off", "on"])
@pytest.mark.parametrize("attention", ["sdpa", "sglang_bcg_break"])
def test_llama_4d_mask_gpu(attention: str, mode: str, engine: str) -> None:
    llama_4d_mask_case(attention, mode, "cuda", engine)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("extra", ["tensor", "plain"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["full", "breakable", "piecewise"])
def test_extra_attribute_gpu(name: str, kind: str, extra: str, mode: str, engine: str) -> None:
    quietly(extra_attribute_case, name, kind, extra, mode, "cuda", engine)


@pytest.mark.parametrize("engine", ENGINES)
def test_replay_property_gpu(engine: str) -> None:
    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(PROPERTY)
    def run(case: dict[str, Any]) -> None:
        replay_property(**case, device="cuda", engine=engine)

    run()
