"""Replay in another autograd context than the capture, and broadcast (self-overlapping) outputs.

1. A capture under ``torch.inference_mode()`` (as SGLang does) replays outside it, and a capture
   under ``torch.no_grad()`` replays inside it, with the eager forward's values: a CUDA graph's
   kernels write their memory whatever the caller's mode, so the eager engines replay in the mode
   of the capture (Full's forward re-runs in it; the op tape and the breaks run in it). The
   outputs are what a CUDA graph hands out (inference tensors after an inference-mode capture):
   plain autograd-off code can use them.
2. A Full, Breakable or Piecewise output that broadcasts (``h[:, :1].expand(n, 8)``, stride 0,
   ``as_strided`` overlaps) replays with the eager forward's values: as a graph replay rewrites
   the memory under the view, the eager engines write the elements the view reads.

Each case is a function of ``(device, engine)``; ``tests/gpu/test_replay_contexts_gpu.py`` runs
the same cases on real CUDA graphs and on the eager engine with CUDA tensors.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

from sglang_bcg_plugin import BackendOptions, ShapeKey, SharedOutputFallbackWarning, create_backend, graph_break
from sglang_bcg_plugin.engines.recorder import refresh
from sglang_bcg_plugin.engines.recorder import copy_broadcast
from splitting_ops import write_softmax

MODES = ["off", "on", "released"]
SOURCES = ["auto", "adopt", "reserve"]
NAMES = ["full", "breakable", "piecewise"]
CONTEXTS: dict[str, Callable[[], contextlib.AbstractContextManager[Any]]] = {
    "plain": contextlib.nullcontext,
    "no_grad": torch.no_grad,
    "inference": torch.inference_mode,
}
#: (capture context, replay context): the issue's case first, then the others of the brief.
PAIRS = [
    ("inference", "plain"),
    ("inference", "no_grad"),
    ("inference", "inference"),
    ("no_grad", "inference"),
    ("no_grad", "plain"),
]
SIZES = (8, 4)


@graph_break(reads=("x",), writes=("out",))
def _softmax_into(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(torch.softmax(x, dim=-1))


@graph_break(reads=("x",))
def _first_column(x: torch.Tensor) -> torch.Tensor:
    """A break returning a broadcast of a tensor it made."""
    return (x[:, :1] + 1).expand(x.shape[0], x.shape[1])


class _Model(torch.nn.Module):
    """One model for the three backends: Breakable sees a ``@graph_break``, Piecewise a
    splitting op; Full runs either as a plain call. ``out`` picks the returned tree."""

    def __init__(self, name: str, device: str, out: Callable[[torch.Tensor], Any] | None = None) -> None:
        super().__init__()
        self.name = name
        self.out = out
        g = torch.Generator().manual_seed(7)
        self.register_buffer("w", torch.randn(8, 8, generator=g).to(device))

    def forward(self, x: torch.Tensor) -> Any:
        h = x @ self.w
        h.add_(1.0)  # in-place work on an intermediate (an inference tensor under inference mode)
        out = torch.empty_like(h)
        if self.name == "piecewise":
            write_softmax(h, out)
        else:
            _softmax_into(h, out)
        h = out @ self.w + h
        return h if self.out is None else self.out(h)


def _capture(name: str, mode: str, device: str, engine: str, model: _Model, x: torch.Tensor,
             ctx: str = "no_grad", **opts: Any) -> tuple[Any, Callable[[int], Any]]:
    """The backend with ``SIZES`` captured under ``ctx``, and the eager forward of a size."""
    extra: dict[str, Any] = {}
    if name == "piecewise":
        torch._dynamo.reset()
        extra["splitting_ops"] = [torch.ops.sglang_bcg_test.write_softmax.default]
    backend = create_backend(name, options=BackendOptions(output_mode=mode, engine=engine, **opts), **extra)
    fn = backend.compile(model)
    with CONTEXTS[ctx](), backend.capture_session():
        for n in SIZES:
            backend.capture_one(ShapeKey(n), lambda n=n: fn(x[:n] * 2), capture_inputs=x)

    def eager(n: int) -> Any:
        with torch.no_grad():
            return model(x[:n] * 2)

    return backend, eager


def replay_context_case(name: str, mode: str, capture_ctx: str, replay_ctx: str, device: str, engine: str) -> None:
    """Capture in one autograd context, replay in another: the eager forward's values, and an
    output that plain autograd-off code can use."""
    x = torch.randn(8, 8, device=device)  # the caller's static input, made outside any mode
    model = _Model(name, device)
    backend, eager = _capture(name, mode, device, engine, model, x, capture_ctx)
    for _ in range(2):
        x.copy_(torch.randn_like(x))  # the caller changes its input (outside inference mode)
        for n in SIZES:
            with CONTEXTS[replay_ctx]():
                got = backend.replay(ShapeKey(n))
            want = eager(n)
            torch.testing.assert_close(got, want)
            with torch.no_grad():  # what a caller does with a replayed output
                torch.testing.assert_close(got * 2 + 1, want * 2 + 1)
                torch.testing.assert_close(got.clone().add_(1), want + 1)
    if name == "piecewise":
        torch._dynamo.reset()


def mixed_partition_case(name: str, source: str, first: str, device: str, engine: str) -> None:
    """Sharing on, the first key captured in one mode, the next in the other: a buffer made under
    inference mode cannot be written outside it, so that key keeps its own output (one warning
    naming the cause); every key replays the eager values in any replay context."""
    x = torch.randn(8, 8, device=device)
    second = "no_grad" if first == "inference" else "inference"
    backend = create_backend(name, options=BackendOptions(output_mode="on", engine=engine, shared_buffer=source))
    model = _Model(name, device)
    with backend.capture_session():
        with CONTEXTS[first]():
            backend.capture_one(ShapeKey(8), lambda: model(x * 2), capture_inputs=x)
        with CONTEXTS[second](), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            backend.capture_one(ShapeKey(4), lambda: model(x[:4] * 2), capture_inputs=x)
    fallbacks = [w for w in caught if issubclass(w.category, SharedOutputFallbackWarning)]
    if first == "inference":
        assert len(fallbacks) == 1 and "torch.inference_mode()" in str(fallbacks[0].message)
        assert backend.memory_report().fallbacks
    else:
        assert not fallbacks
    for replay_ctx in CONTEXTS:
        x.copy_(torch.randn_like(x))
        for n in SIZES:
            with CONTEXTS[replay_ctx]():
                got = backend.replay(ShapeKey(n))
            with torch.no_grad():
                torch.testing.assert_close(got, model(x[:n] * 2))


#: Outputs that broadcast or overlap themselves, from the forward's last tensor ``h`` ``[n, 8]``.
BROADCASTS: dict[str, Callable[[torch.Tensor], Any]] = {
    "expand": lambda h: h[:, :1].expand(h.shape[0], 8),
    "expand_row": lambda h: h[0].expand(h.shape[0], 8),
    "stride0": lambda h: h[:1].as_strided((h.shape[0], 8), (0, 1)),
    "all_stride0": lambda h: h[0, 0].expand(h.shape[0], 8),
    "overlap": lambda h: h.reshape(-1).as_strided((h.shape[0], 4), (2, 1)),
    "tree": lambda h: {"b": h[:, :1].expand(h.shape[0], 8), "h": h, "t": (h[1].expand(3, 8),)},
    "break_return": lambda h: _first_column(h),
}


def broadcast_case(name: str, kind: str, mode: str, source: str, device: str, engine: str) -> None:
    """A broadcast output replays the eager forward's values, in every mode and buffer source."""
    x = torch.randn(8, 8, device=device)
    model = _Model(name, device, BROADCASTS[kind])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SharedOutputFallbackWarning)  # a documented outcome
        backend, eager = _capture(name, mode, device, engine, model, x, shared_buffer=source)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        for n in SIZES:
            torch.testing.assert_close(backend.replay(ShapeKey(n)), eager(n))
    if name == "piecewise":
        torch._dynamo.reset()


# -- CPU ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("capture_ctx", "replay_ctx"), PAIRS)
@pytest.mark.parametrize("name", NAMES)
def test_replay_in_another_autograd_context_than_the_capture(name: str, capture_ctx: str, replay_ctx: str, mode: str) -> None:
    replay_context_case(name, mode, capture_ctx, replay_ctx, "cpu", "eager")


@pytest.mark.parametrize("first", ["inference", "no_grad"])
@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("name", ["full", "breakable"])
def test_a_partition_captured_in_two_modes(name: str, source: str, first: str) -> None:
    mixed_partition_case(name, source, first, "cpu", "eager")


#: (backend, broadcast kind): a ``@graph_break`` returning a broadcast is a Breakable case (Full
#: runs it as a plain call).
BROADCAST_CASES = [(n, k) for n in NAMES for k in BROADCASTS if not (n == "piecewise" and k == "break_return")]


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("name", "kind"), BROADCAST_CASES)
def test_a_broadcast_output_replays_the_eager_values(name: str, kind: str, mode: str, source: str) -> None:
    broadcast_case(name, kind, mode, source, "cpu", "eager")


def test_inference_outputs_are_what_a_cuda_graph_hands_out() -> None:
    """After an inference-mode capture the output is an inference tensor (as a graph's output
    made under it is), usable by plain code; writing it in place outside inference mode is
    torch's own refusal, as with a graph's output."""
    x = torch.randn(8, 8)
    backend, _ = _capture("full", "off", "cpu", "eager", _Model("full", "cpu"), x, "inference")
    got = backend.replay(ShapeKey(4))
    assert got.is_inference()
    assert not (got * 2).is_inference()
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
        got.add_(1)


def test_a_forward_whose_replay_stops_broadcasting_is_one_clear_error() -> None:
    """Full's eager engine re-runs the forward's Python: a forward that broadcast at capture and
    returns varying values along that dim at replay cannot be held by the captured view (a CUDA
    graph would replay the broadcast); equal values materialised are fine."""
    x = torch.randn(8, 8)
    calls = {"n": 0}

    def forward() -> torch.Tensor:
        calls["n"] += 1
        h = x * 2
        return h[:, :1].expand(8, 8) if calls["n"] <= 3 else h  # 2 warmups + the capture

    backend = create_backend("full", options=BackendOptions(output_mode="off", engine="eager"))
    with torch.no_grad(), backend.capture_session():
        backend.capture_one(ShapeKey(8), forward, capture_inputs=x)
    with pytest.raises(RuntimeError, match=r"vary along dim 1 on replay, where the captured output broadcasts"):
        backend.replay(ShapeKey(8))


def test_copy_broadcast_checks_values_that_come_materialised() -> None:
    base = torch.arange(4.0)[:, None]
    static = base.expand(4, 3)
    new = (base + 1).expand(4, 3).contiguous()
    assert copy_broadcast(static, new, "op") is True  # equal values, materialised
    torch.testing.assert_close(static, new)
    nan = torch.full((4, 1), float("nan")).expand(4, 3)
    assert copy_broadcast(static, nan.contiguous(), "op") is True  # NaN equals NaN
    ints = torch.zeros(2, 1, dtype=torch.int64).expand(2, 5)
    with pytest.raises(RuntimeError, match=r"op returned values that vary along dim 1"):
        copy_broadcast(ints, torch.arange(10).reshape(2, 5), "op")
    assert copy_broadcast(torch.zeros(3), torch.ones(3), "op") is False  # nothing broadcasts


def test_refresh_keeps_torchs_error_when_nothing_broadcasts() -> None:
    with torch.inference_mode():
        static = torch.zeros(3)
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor"):
        refresh(static, torch.ones(3), "op")
