"""The replay property of ``tests/test_properties_replay.py`` on real CUDA graphs (and on the
eager engine over CUDA tensors): replay == eager after the inputs change, off / on / released."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from test_properties_replay import case_strategy, check_case

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("engine", ["cuda", "eager"])
def test_replay_equals_eager_on_cuda(engine: str) -> None:
    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(case=case_strategy)
    def run(case: dict[str, Any]) -> None:
        check_case(case, "cuda", engine)

    run()
