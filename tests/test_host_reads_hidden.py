"""Host reads the op tape did not see, refused on the eager segments as a CUDA stream capture does.

1. Inside a ``torch.library`` custom op called in a Breakable segment: the tape saw the op whole
   (a dispatch mode is off while it handles an op), so ``.item()``, ``.tolist()``, ``bool(t)``,
   printing, ``.cpu()``, ``nonzero`` or ``.numpy()`` in its body captured on CPU. Now the body runs
   below the tape's dispatch key with a watch pushed anew: one :class:`HostReadError` naming the
   op and the body's line; the key is rolled back and the backend captures again.
2. Inside a model compiled by the Piecewise backend: the pieces ran with the tape paused (they
   replay themselves), so such a custom op in the model, an ``.item()`` dynamo keeps in the graph
   (``capture_scalar_outputs``) or a boolean mask captured on CPU. Now the pieces run watched at
   capture. Splitting ops and ``@graph_break`` bodies run eagerly at every replay: reads there
   stay fine.
3. Under ``torch.inference_mode()`` (as SGLang captures) ``bool(t)`` and ``if t:`` reached the tape
   as ``is_nonzero``, an op made of others, and captured; now its parts are watched.
4. No false refusals: custom ops doing shape arithmetic (``.shape``, ``.size()``, ``numel``,
   ``torch.empty``, ``new_zeros``, views, writing into an ``out`` argument) capture, and replay
   equals eager after the inputs change, on both backends and in both autograd modes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from sglang_bcg_plugin import BackendOptions, HostReadError, ShapeKey, create_backend, graph_break

from splitting_ops import mix  # tests/splitting_ops.py


def _fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _op(name: str, body: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    op = torch.library.custom_op(f"sglang_bcg_hidden::{name}", mutates_args=())(body)
    op.register_fake(_fake)
    return op


def _scale_by_max(x: torch.Tensor) -> torch.Tensor:
    return x * x.abs().max().item()


def _scale_by_first(x: torch.Tensor) -> torch.Tensor:
    return x * float(x.tolist()[0][0])


def _branch(x: torch.Tensor) -> torch.Tensor:
    return x * 2 if bool(x[0, 0] > 0) else x * 3


def _prints(x: torch.Tensor) -> torch.Tensor:
    print(x)
    return x + 1


def _to_host(x: torch.Tensor) -> torch.Tensor:
    return x.cpu() * 2


def _count_positive(x: torch.Tensor) -> torch.Tensor:
    return x * (x > 0).nonzero().shape[0]


def _via_numpy(x: torch.Tensor) -> torch.Tensor:
    return x - float(x.numpy()[-1, -1])


def _formats(x: torch.Tensor) -> torch.Tensor:
    assert f"{x.sum()}"
    return x * 4


#: name -> (the op, what HostReadError.op says, the body's line text)
READING: dict[str, tuple[Any, str, str]] = {
    "item": (_op("scale_by_max", _scale_by_max), "item", "_scale_by_max"),
    "tolist": (_op("scale_by_first", _scale_by_first), "Tensor.tolist()", "_scale_by_first"),
    "bool": (_op("branch", _branch), "item", "_branch"),
    "print": (_op("prints", _prints), "printing a tensor", "_prints"),
    "cpu": (_op("to_host", _to_host), "Tensor.cpu()", "_to_host"),
    "nonzero": (_op("count_positive", _count_positive), "aten.nonzero", "_count_positive"),
    "numpy": (_op("via_numpy", _via_numpy), "Tensor.numpy()", "_via_numpy"),
    "format": (_op("formats", _formats), "formatting a tensor", "_formats"),
}

_LIB = torch.library.Library("sglang_bcg_hidden", "FRAGMENT")
_LIB.define("lib_scale(Tensor x) -> Tensor")
_LIB.impl("lib_scale", _scale_by_max, "CompositeExplicitAutograd")
_LIB.impl("lib_scale", _fake, "Meta")
READING["library"] = (torch.ops.sglang_bcg_hidden.lib_scale.default, "item", "_scale_by_max")


@torch.library.custom_op("sglang_bcg_hidden::outer", mutates_args=())
def _outer(x: torch.Tensor) -> torch.Tensor:
    return READING["item"][0](x * 2) - 1  # a custom op calling one that reads


_outer.register_fake(_fake)
READING["nested"] = (_outer, "item", "_scale_by_max")


@torch.library.custom_op("sglang_bcg_hidden::reshape_rows", mutates_args=())
def _reshape_rows(x: torch.Tensor) -> torch.Tensor:
    """Shape arithmetic only: sizes, numel, allocations, views, a fill."""
    rows, cols = x.shape[0], x.size(1)
    out = torch.empty(rows, cols, dtype=x.dtype)
    out.copy_(x.view(x.numel() // cols, cols) * rows)
    return out + x.new_zeros(x.shape) + torch.ones_like(x).sum(0, keepdim=True) / cols


_reshape_rows.register_fake(_fake)


@torch.library.custom_op("sglang_bcg_hidden::write_scaled", mutates_args=("out",))
def _write_scaled(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x.flip(0) * x.shape[-1])


@_write_scaled.register_fake
def _(x: torch.Tensor, out: torch.Tensor) -> None:
    return None


def _clean(h: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(h)
    _write_scaled(_reshape_rows(h), out)
    return out * 2


MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _backend(name: str, ops: list[Any] | None = None) -> Any:
    extra = {"splitting_ops": ops or []} if name == "piecewise" else {}
    return create_backend(name, options=BackendOptions(output_mode="on", engine="eager"), **extra)


def _forward(name: str, backend: Any, body: Callable[[torch.Tensor], torch.Tensor],
             x: torch.Tensor) -> Callable[[int], torch.Tensor]:
    """Work before and after ``body``: in the Breakable segment, or in the compiled model."""
    if name == "piecewise":
        compiled = backend.compile(lambda h: body(h * 2) + 1)
        return lambda n: compiled(x[:n]) * 3
    return lambda n: body(x[:n] * 2) * 3 + 1


def _replays_eager(backend: Any, sizes: list[int], x: torch.Tensor, eager: Callable[[int], torch.Tensor]) -> None:
    for _ in range(2):
        x.copy_(torch.randn(x.shape))
        for n in sizes:
            got = backend.replay(ShapeKey(n))
            with torch.no_grad():
                torch.testing.assert_close(got, eager(n))


@pytest.mark.parametrize("autograd", sorted(MODES))
@pytest.mark.parametrize("read", sorted(READING))
@pytest.mark.parametrize("name", ["breakable", "piecewise"])
def test_a_host_read_inside_a_custom_op_is_refused(name: str, read: str, autograd: str) -> None:
    op, text, line = READING[read]
    x = torch.randn(6, 4)
    backend = _backend(name)
    forward = _forward(name, backend, op, x)
    with MODES[autograd](), backend.capture_session():
        with pytest.raises(HostReadError) as info:
            backend.capture_one(ShapeKey(6), lambda: forward(6), capture_inputs=x)
        err = info.value
        assert err.shape_key == ShapeKey(6) and err.segment == 0, str(err)
        assert text in err.op, err.op
        assert err.where is not None and "test_host_reads_hidden.py" in err.where and line in err.where, err.where
        assert not backend.can_run(ShapeKey(6))
        clean = _forward(name, backend, _clean, x)  # the same backend captures a forward that reads nothing
        backend.capture_one(ShapeKey(6), lambda: clean(6), capture_inputs=x)
    _replays_eager(backend, [6], x, lambda n: _clean(x[:n] * 2) * 3 + 1 if name == "breakable"
                   else (_clean(x[:n] * 2) + 1) * 3)
    backend.cleanup()


@pytest.mark.parametrize("autograd", sorted(MODES))
@pytest.mark.parametrize("name", ["breakable", "piecewise"])
def test_custom_ops_that_read_no_values_capture_and_replay_eager(name: str, autograd: str) -> None:
    x = torch.randn(8, 4)
    backend = _backend(name)
    forward = _forward(name, backend, _clean, x)
    sizes = [8, 5, 1]
    with MODES[autograd](), backend.capture_session():
        for n in sizes:
            backend.capture_one(ShapeKey(n), lambda n=n: forward(n), capture_inputs=x)
    if name == "breakable":
        _replays_eager(backend, sizes, x, lambda n: _clean(x[:n] * 2) * 3 + 1)
    else:
        _replays_eager(backend, sizes, x, lambda n: (_clean(x[:n] * 2) + 1) * 3)


def test_piecewise_refuses_reads_dynamo_keeps_in_the_graph() -> None:
    """``.item()`` kept as a graph node (``capture_scalar_outputs``) and a boolean mask: a piece's
    CUDA graph would replay the capture's number and shape."""
    x = torch.randn(6, 4)
    models: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], str]] = {
        "item": (lambda h: h * (h * 2).max().item(), "(.item(), bool(t)"),
        "mask": (lambda h: torch.zeros(6, 4).index_put((h > 0,), h[h > 0] * 2), "boolean mask"),
    }
    for model, text in models.values():
        torch._dynamo.reset()
        backend = _backend("piecewise")
        compiled = backend.compile(model, dynamic="backed")
        with torch._dynamo.config.patch(capture_scalar_outputs=True), torch.no_grad(), backend.capture_session():
            with pytest.raises(HostReadError) as info:
                backend.capture_one(ShapeKey(6), lambda c=compiled: c(x), capture_inputs=x)
        assert text in info.value.op and info.value.segment == 0


def test_reads_in_splitting_ops_and_break_bodies_stay_fine() -> None:
    """Both run eagerly at every replay, so they read the new values (on CUDA too)."""
    reading = READING["item"][0]
    x = torch.randn(6, 4)

    @torch.library.custom_op("sglang_bcg_hidden::split_reads", mutates_args=())
    def split_reads(h: torch.Tensor) -> torch.Tensor:
        return reading(h) + float(h.tolist()[0][0])

    split_reads.register_fake(_fake)

    @graph_break(reads="h")
    def break_reads(h: torch.Tensor) -> torch.Tensor:
        print(h.shape, h.sum())
        return split_reads(h) * 2

    piecewise = _backend("piecewise", [split_reads])
    compiled = piecewise.compile(lambda h: mix(split_reads(h * 2)) + 1)
    breakable = _backend("breakable")
    with torch.no_grad(), piecewise.capture_session(), breakable.capture_session():
        piecewise.capture_one(ShapeKey(6), lambda: compiled(x), capture_inputs=x)
        breakable.capture_one(ShapeKey(6), lambda: break_reads(x * 2) - 1, capture_inputs=x)
    assert piecewise.num_segments(ShapeKey(6)) == 2
    for _ in range(2):
        x.copy_(torch.randn(6, 4))
        torch.testing.assert_close(breakable.replay(ShapeKey(6)), break_reads(x * 2) - 1)
        torch.testing.assert_close(piecewise.replay(ShapeKey(6)), mix(split_reads(x * 2)) + 1)


@pytest.mark.parametrize("read", ["bool", "if", "int"])
def test_under_inference_mode_a_truth_test_in_a_segment_is_refused(read: str) -> None:
    """``is_nonzero`` reaches the tape whole for inference tensors; its ``item`` is refused."""
    x = torch.randn(6, 4)

    def forward() -> torch.Tensor:
        h = x * 2
        if read == "bool":
            s = 2.0 if bool(h[0, 0] > 0) else 3.0
        elif read == "if":
            s = 2.0 if h[0, 0] > 0 else 3.0
        else:
            s = float(int(h[0, 0] > 0))
        return h * s

    backend = _backend("breakable")
    with torch.inference_mode(), backend.capture_session():
        with pytest.raises(HostReadError, match=r"\.item\(\), bool\(t\)"):
            backend.capture_one(ShapeKey(6), forward, capture_inputs=x)


@torch.library.custom_op("sglang_bcg_hidden::filled", mutates_args=())
def _filled(rows: int, value: float) -> torch.Tensor:
    """No tensor argument: nothing of the forward's to read (run as it is)."""
    return torch.full((rows, 4), value)


@_filled.register_fake
def _(rows: int, value: float) -> torch.Tensor:
    return torch.empty(rows, 4)


def test_a_custom_op_without_tensor_arguments_is_recorded_as_it_is() -> None:
    x = torch.randn(6, 4)
    backend = _backend("breakable")
    with torch.no_grad(), backend.capture_session():
        backend.capture_one(ShapeKey(6), lambda: x * _filled(6, 2.0), capture_inputs=x)
    x.copy_(torch.randn(6, 4))
    torch.testing.assert_close(backend.replay(ShapeKey(6)), x * 2.0)


def test_tensor_subclasses_and_closed_segments_are_left_alone() -> None:
    """A tensor that dispatches in Python itself (a fake tensor) keeps its own dispatch; no
    segment open, nothing to watch."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from sglang_bcg_plugin.engines.tape import EagerSegments, _body_keys

    with FakeTensorMode():
        fake = torch.empty(2, 4)
    op = READING["item"][0]._opoverload
    assert _body_keys(op, (fake,), {}) is None
    assert _body_keys(op, (torch.empty(2, 4),), {}) is not None
    assert _body_keys(torch.ops.aten.mul.Tensor, (torch.empty(2),), {}) is None
    with EagerSegments("key").watched():
        assert torch.ones(1).item() == 1.0  # no open segment: a read is no capture's
