"""Never a silent wrong value: forwards that replayed wrong on the eager engine (issue cases).

1. Work the forward does outside the compiled callable or around breaks (``fn(x[:n] * 2)``,
   ``fn(x) * 2``) is replayed: the eager engine records it on its segments' op tape, as a CUDA
   capture records its kernels.
2. A forward returning memory it did not allocate (a view of a user's tensor, no
   ``capture_inputs``) never becomes the shared buffer: the user's tensor is never written, and
   replay equals eager after the tensor changed.

Each case is a function of ``(device, engine)``; ``tests/gpu/test_wrong_values_gpu.py`` runs the
same cases on real CUDA graphs and on the eager engine with CUDA tensors, so both engines are
held to what a caller sees.
"""

from __future__ import annotations

from sglang_bcg_plugin.output.mode import mode_of_option

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

from sglang_bcg_plugin import BackendOptions, ShapeKey, create_backend, graph_break
from splitting_ops import write_softmax

MODES: list[Any] = [False, True, "released"]
SOURCES = ["auto", "adopt", "reserve"]


def _backend(name: str, mode: Any, engine: str, **opts: Any) -> Any:
    return create_backend(name, options=BackendOptions(output_mode=mode_of_option(mode), engine=engine, **opts))


def user_view_case(name: str, mode: Any, source: str, warmups: int, device: str, engine: str) -> None:
    """``lambda: static[-n:]`` with no ``capture_inputs``: capture must not write ``static``."""
    static = torch.arange(32.0, device=device).reshape(8, 4)
    before = static.clone()
    backend = _backend(name, mode, engine, shared_buffer=source, num_warmups=warmups)
    sizes = (8, 4, 2)
    with torch.no_grad(), backend.capture_session():
        for n in sizes:
            backend.capture_one(ShapeKey(n), lambda n=n: static[-n:] * 1 if name == "breakable" else static[-n:])
    torch.testing.assert_close(static, before)  # capture wrote nothing into the user's tensor
    static.copy_(torch.randn_like(static))
    for n in sizes:
        got = backend.replay(ShapeKey(n))
        torch.testing.assert_close(got, static[-n:])


@graph_break(reads=("x",), writes=("out",))
def _attention(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(torch.softmax(x, dim=-1))


def around_breaks_case(mode: Any, device: str, engine: str) -> None:
    """Breakable: eager ops before the first break and after the last are replayed."""
    g = torch.Generator(device="cpu").manual_seed(0)
    w = torch.randn(4, 4, generator=g).to(device)
    x = torch.randn(8, 4, generator=g).to(device)

    def forward(n: int) -> torch.Tensor:
        h = (x[:n] * 2) @ w
        out = torch.empty_like(h)
        _attention(h, out)
        return out @ w + 1

    backend = _backend("breakable", mode, engine)
    with torch.no_grad(), backend.capture_session():
        for n in (8, 4):
            backend.capture_one(ShapeKey(n), lambda n=n: forward(n), capture_inputs=x)
    assert backend.num_segments(ShapeKey(8)) == 2
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        for n in (8, 4):
            got = backend.replay(ShapeKey(n))
            with torch.no_grad():
                torch.testing.assert_close(got, forward(n))


class _Attn(torch.nn.Module):
    def __init__(self, device: str) -> None:
        super().__init__()
        self.register_buffer("w", torch.randn(4, 4, generator=torch.Generator().manual_seed(3)).to(device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.w
        out = torch.empty_like(h)
        write_softmax(h, out)
        return out @ self.w


def piecewise_prologue_case(mode: Any, device: str, engine: str) -> None:
    """The issue's case: ``fn(x[:s] * 2)`` replays ``model(x * 2)`` with the new ``x``."""
    torch._dynamo.reset()
    model = _Attn(device)
    backend = create_backend(
        "piecewise",
        options=BackendOptions(output_mode=mode_of_option(mode), engine=engine),
        splitting_ops=[torch.ops.sglang_bcg_test.write_softmax.default],
    )
    fn = backend.compile(model)
    x = torch.randn(8, 4, device=device)
    with torch.no_grad(), backend.capture_session():
        for s in (8, 4):
            backend.capture_one(ShapeKey(s), lambda s=s: fn(x[:s] * 2), capture_inputs=x)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        for s in (8, 4):
            got = backend.replay(ShapeKey(s))
            with torch.no_grad():
                torch.testing.assert_close(got, model(x[:s] * 2))
    torch._dynamo.reset()


def run_quietly(case: Callable[..., None], *args: Any) -> None:
    """Run a case; a sharing fallback warning is allowed (a documented outcome), nothing else."""
    from sglang_bcg_plugin import SharedOutputFallbackWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SharedOutputFallbackWarning)
        case(*args)


@pytest.mark.parametrize("warmups", [0, 2])
@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["full", "breakable"])
def test_a_view_of_a_users_tensor_never_becomes_the_shared_buffer(name: str, mode: Any, source: str, warmups: int) -> None:
    run_quietly(user_view_case, name, mode, source, warmups, "cpu", "eager")


@pytest.mark.parametrize("mode", MODES)
def test_breakable_replays_work_around_its_breaks(mode: Any) -> None:
    around_breaks_case(mode, "cpu", "eager")


@pytest.mark.parametrize("mode", MODES)
def test_piecewise_replays_work_before_the_compiled_callable(mode: Any) -> None:
    piecewise_prologue_case(mode, "cpu", "eager")


def test_adopt_still_adopts_the_forwards_own_output() -> None:
    """The ownership rule costs nothing where the forward allocates its output: the first key's
    output *is* the buffer (no copy), as before."""
    x = torch.randn(8, 4)
    backend = _backend("full", True, "eager", shared_buffer="adopt")
    with torch.no_grad(), backend.capture_session():
        outs = {n: backend.capture_one(ShapeKey(n), lambda n=n: x[:n] * 2, capture_inputs=x) for n in (8, 4)}
    assert outs[4].untyped_storage().data_ptr() == outs[8].untyped_storage().data_ptr()
    report = backend.memory_report()
    assert report.resident_output_bytes == 8 * 4 * 4


def test_capture_one_inside_a_forward_is_a_reentrant_capture_error() -> None:
    from sglang_bcg_plugin import CaptureStateError

    backend = _backend("full", False, "eager")
    x = torch.randn(4, 4)

    def forward() -> torch.Tensor:
        backend.capture_one(ShapeKey(2), lambda: x[:2] * 2)
        return x * 2

    with torch.no_grad(), backend.capture_session():
        with pytest.raises(CaptureStateError, match=r"re-entrant capture: capture_one\(.*size=2.*while .*size=4"):
            backend.capture_one(ShapeKey(4), forward)
        backend.capture_one(ShapeKey(4), lambda: x * 2)  # the backend is still usable
    assert backend.captured_keys() == [ShapeKey(4)]
