"""Every output mode on the installed release's own breakable graph, on either seam.

For ``on``, ``off`` and ``released``, over the output kinds SGLang's prefill and decode bodies
return: a tensor; spec decode's ``4 * size`` rows (rows come from the output, not the key); a
tuple with a ``None`` leaf; ``LogitsProcessorOutput`` (a dataclass, with ``None`` fields);
``PPProxyTensors``. After the captures the static inputs change, and every replay must equal an
eager forward of the new inputs exactly. A key whose structure differs falls back to its own
output with one warning.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from seam_drivers import close, make_driver, storages
from sglang_bcg_plugin import SharedOutputFallbackWarning
from sglang_bcg_plugin.output import released as rel

pytestmark = [pytest.mark.sglang, pytest.mark.usefixtures("cpu_bcg")]

HIDDEN = 8
SIZES = (16, 8, 4)
ENV = "SGLANG_ENABLE_BCG_SHARED_OUTPUT"


def _logits(h: torch.Tensor) -> Any:
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput

    return LogitsProcessorOutput(next_token_logits=h + 1, hidden_states=h)


def _proxy(h: torch.Tensor) -> Any:
    from sglang.srt.model_executor.forward_batch_info import PPProxyTensors

    return PPProxyTensors({"hidden_states": h, "residual": h * 3})


#: name -> (rows per size, how the body's tensor becomes the output)
KINDS: dict[str, tuple[int, Callable[[torch.Tensor], Any]]] = {
    "tensor": (1, lambda h: h),
    "spec_rows": (4, lambda h: h),  # spec decode: 4 * size rows
    "tuple_with_none": (1, lambda h: (h, None, h.sum(dim=1))),
    "logits_dataclass": (1, _logits),
    "pp_proxy": (1, _proxy),
}


class Model:
    """``tanh(x @ w)`` with an eager break (SGLang's ``eager_on_graph``), then ``* 2``."""

    def __init__(self, rows: int, make: Callable[[torch.Tensor], Any]) -> None:
        from conftest import eager_break

        self.w = torch.randn(HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(0))
        self.rows, self.make = rows, make
        self.inputs: dict[int, torch.Tensor] = {}
        self.attention = eager_break(lambda h: torch.tanh(h))

    def forward_for(self, size: int) -> Callable[[], Any]:
        x = self.inputs.setdefault(size, torch.randn(self.rows * size, HIDDEN))
        return lambda: self.make(self.attention(x @ self.w) * 2)

    def expected(self, size: int) -> Any:
        return self.make(torch.tanh(self.inputs[size] @ self.w) * 2)

    def refill(self) -> None:
        for x in self.inputs.values():
            x.copy_(torch.randn_like(x))


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (ENV, "SGLANG_BCG_SHARED_BUFFER", "SGLANG_BCG_STALE_OUTPUT_GUARD", "SGLANG_ENABLE_GRAPH_POOL_BORROW"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(rel, "ALIAS_DEVICE_TYPES", frozenset({"cpu"}))  # the stand-in keeps segment storage


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("mode", ["on", "off", "released"])
def test_replay_after_inputs_change(monkeypatch: pytest.MonkeyPatch, mode: str, kind: str) -> None:
    monkeypatch.setenv(ENV, mode)
    driver, model = make_driver(monkeypatch), Model(*KINDS[kind])
    keys = [driver.key(n) for n in SIZES]
    driver.capture({key: model.forward_for(key.size) for key in keys})
    model.refill()  # outputs must follow the inputs, not the capture-time values
    for key in reversed(keys):
        close(driver.replay(key), model.expected(key.size))
    report = driver.report()
    leaves = len(storages([model.expected(SIZES[0])]))
    if mode == "on":
        assert len(storages(driver.outputs())) == leaves  # one buffer per leaf path
        assert all(k.shared for k in report.keys) and report.resident_output_bytes < report.logical_output_bytes
    elif mode == "off":
        assert len(storages(driver.outputs())) == leaves * len(SIZES)
        assert report.resident_output_bytes == report.logical_output_bytes
    else:
        assert report.resident_output_bytes == 0 and report.logical_output_bytes > 0
    driver.cleanup()


def test_structure_change_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "on")
    driver = make_driver(monkeypatch)
    model = Model(1, lambda h: h)
    small = Model(1, lambda h: (h, h + 1))  # a different tree for the smallest size
    small.w = model.w
    keys = [driver.key(n) for n in SIZES]
    forwards = {key: model.forward_for(key.size) for key in keys[:-1]}
    forwards[keys[-1]] = small.forward_for(keys[-1].size)
    with pytest.warns(SharedOutputFallbackWarning, match="keeps its own output"):
        driver.capture(forwards)
    assert [k.key.size for k in driver.report().keys if k.fallback] == [SIZES[-1]]
    model.refill()
    small.refill()
    close(driver.replay(keys[-1]), small.expected(SIZES[-1]))
    close(driver.replay(keys[0]), model.expected(SIZES[0]))


def test_default_is_the_release_behaviour(monkeypatch: pytest.MonkeyPatch) -> None:
    from conftest import seam

    driver, model = make_driver(monkeypatch), Model(1, lambda h: h)
    keys = [driver.key(n) for n in SIZES]
    driver.capture({key: model.forward_for(key.size) for key in keys})
    shares = seam().builtin.shares
    assert all(k.shared is bool(shares) for k in driver.report().keys)
    assert len(storages(driver.outputs())) == (1 if shares else len(SIZES))


def _break_what_capture_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Change one thing our capture calls, as a later SGLang might."""
    import importlib

    from conftest import seam

    if seam().kind == "runner":
        cls = importlib.import_module("sglang.srt.model_executor.breakable_cuda_graph_runner").BreakableCudaGraphRunner

        hooked = cls._capture_one  # our hook around SGLang's, as the driver installed it

        def _capture_one(self: Any, num_tokens: int, pool: Any, stream: Any) -> Any:  # no forward inside a capture
            return None, None

        monkeypatch.setattr(hooked, "__wrapped__", _capture_one)
        return
    module = importlib.import_module("sglang.srt.model_executor.runner_backend.breakable_cuda_graph_backend")
    original = module.BreakableCUDAGraphCapture

    class Capture(original):  # type: ignore[misc, valid-type]
        def __init__(self, cuda_graph: Any, stream: Any = None) -> None:  # `pool` is gone
            super().__init__(cuda_graph=cuda_graph, pool=None, stream=stream)

    monkeypatch.setattr(module, "BreakableCUDAGraphCapture", Capture)


@pytest.mark.parametrize("broken", [False, True])
def test_doctor_agrees_with_a_real_capture(monkeypatch: pytest.MonkeyPatch, dist_dir: Any, broken: bool) -> None:
    """Doctor says ok exactly when a real capture through our plugin works on this release."""
    import io

    from sglang_bcg_plugin.sglang.doctor import doctor_main

    monkeypatch.syspath_prepend(str(dist_dir))
    driver, model = make_driver(monkeypatch), Model(1, lambda h: h)
    if broken:
        _break_what_capture_calls(monkeypatch)
    out = io.StringIO()
    verdict = doctor_main([], out=out)
    try:
        driver.capture({driver.key(n): model.forward_for(n) for n in SIZES})
    except (TypeError, RuntimeError) as exc:
        captured: BaseException | None = exc
    else:
        captured = None
    assert (verdict == 0) is (captured is None), (out.getvalue(), captured)
    assert ("[MISSING]" in out.getvalue()) is broken


@pytest.mark.usefixtures("runner_seam")
def test_builtin_runner_keeps_one_output_per_size_ours_shares(monkeypatch: pytest.MonkeyPatch) -> None:
    """0.5.13: SGLang's own loop (no hooks) against ours with ``on``, in one test, as the GPU
    test measures them (tests/gpu/test_sglang_runner_gpu.py)."""
    from seam_drivers import RunnerDriver

    model = Model(1, lambda h: h)
    builtin = RunnerDriver(monkeypatch, hooked=False)
    builtin.capture({builtin.key(n): model.forward_for(n) for n in SIZES})
    assert len(storages(builtin.outputs())) == len(SIZES) and builtin.report() is None
    monkeypatch.setenv(ENV, "on")
    ours = RunnerDriver(monkeypatch)
    ours.capture({ours.key(n): model.forward_for(n) for n in SIZES})
    assert len(storages(ours.outputs())) == 1
    model.refill()
    for n in SIZES:
        close(builtin.replay(builtin.key(n)), model.expected(n))
        close(ours.replay(ours.key(n)), model.expected(n))
