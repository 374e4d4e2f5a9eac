"""``graph_break`` on any callable (docs/breakable.md, "Break points on any callable").

1. Without ``reads``/``writes`` every callable is a break point: builtins that have no Python
   signature (``torch.add``, SDPA, ``torch.Tensor.add``, a tensor's bound ``matmul``), C functions
   (``operator.mul``), a ``functools.partial``, an object with ``__call__``, a bound method. Captured
   on the Breakable backend's eager segments at two sizes, each replays the eager forward after
   the inputs change.
2. Naming ``reads``/``writes`` needs the callable's signature: on one without, decorating raises
   one :class:`GraphBreakError` (a ``TypeError`` and a ``ValueError``) that says how to wrap it.
   Callables with a signature (a partial of a Python function, a callable object, a bound method)
   take names and alias them as a function's.
3. A number a break returns is fixed at capture (the forward's Python ran once): a replay where
   it comes back different raises instead of replaying the capture's value (``math.fsum``).
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable
from typing import Any

import pytest
import torch

from sglang_bcg_plugin import BackendOptions, GraphBreakError, ShapeKey, create_backend, graph_break

F = torch.nn.functional
SIZES = (8, 5)


class _Scale:
    """A callable object: ``__call__`` has a signature, the instance no ``__qualname__``."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a * self.factor - b

    def mix(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.tanh(a) + b * self.factor


def _sum3(a: torch.Tensor, b: torch.Tensor, c: float) -> torch.Tensor:
    return a + b * c


_W = torch.randn(4, 4, generator=torch.Generator().manual_seed(3))

#: name -> a callable of two [n, 4] tensors
CALLABLES: dict[str, Callable[..., Any]] = {
    "torch.add": torch.add,
    "torch.Tensor.add": torch.Tensor.add,
    "operator.mul": operator.mul,
    "partial(torch.add)": functools.partial(torch.add, alpha=2),
    "partial(def)": functools.partial(_sum3, c=0.5),
    "callable object": _Scale(3.0),
    "bound method": _Scale(-2.0).mix,
}


def _forward(fn: Callable[..., Any], x: torch.Tensor, n: int) -> torch.Tensor:
    """Work before the break (a segment), the break, work after it (the next segment)."""
    a, b = x[:n] * 2, x[:n] + 1
    return fn(a, b) * 3 - 1


def _capture_and_replay(forward: Callable[[int], torch.Tensor], x: torch.Tensor, mode: str) -> None:
    backend = create_backend("breakable", options=BackendOptions(output_mode=mode))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad(), backend.capture_session():
        for n in SIZES:
            backend.capture_one(ShapeKey(n), lambda n=n: forward(n), capture_inputs=x)
    for _ in range(2):
        x.copy_(torch.randn(x.shape, generator=g))
        for n in SIZES:
            got = backend.replay(ShapeKey(n))
            with torch.no_grad():
                torch.testing.assert_close(got, forward(n))
    backend.cleanup()


@pytest.mark.parametrize("mode", ["off", "on"])
@pytest.mark.parametrize("name", sorted(CALLABLES))
def test_every_callable_is_a_break_without_names(name: str, mode: str) -> None:
    fn = CALLABLES[name]
    brk = graph_break(fn)
    assert brk.__sglang_bcg_break__ and brk.__wrapped__ is fn  # type: ignore[attr-defined]
    x = torch.randn(8, 4)
    _capture_and_replay(lambda n: _forward(brk, x, n), x, mode)


@pytest.mark.parametrize("mode", ["off", "released"])
def test_builtin_attention_and_a_bound_builtin_are_breaks(mode: str) -> None:
    """SDPA (keyword arguments too) and ``weight.matmul``, the builtins a model calls."""
    sdpa, matmul = graph_break(F.scaled_dot_product_attention), graph_break(_W.matmul)
    x = torch.randn(8, 16)

    def forward(n: int) -> torch.Tensor:
        q = (x[:n] * 2).view(1, 2, n, 8)
        k, v = (x[:n] + 1).view(1, 2, n, 8), (x[:n] - 1).view(1, 2, n, 8)
        att = sdpa(q, k, v, is_causal=True)
        return matmul(att.reshape(n, 16).view(n * 4, 4).T).sum(0) + 1

    _capture_and_replay(forward, x, mode)


@pytest.mark.parametrize(("fn", "names"), [
    (torch.add, {"reads": "input"}),
    (F.scaled_dot_product_attention, {"reads": ("query", "key", "value")}),
    (functools.partial(torch.add, alpha=2), {"writes": "out"}),
    (torch.Tensor.add_, {"writes": "self"}),
])
def test_names_on_a_callable_without_a_signature_say_how_to_wrap_it(fn: Callable[..., Any],
                                                                     names: dict[str, Any]) -> None:
    with pytest.raises(GraphBreakError) as info:
        graph_break(**names)(fn)
    err, text = info.value, str(info.value)
    assert isinstance(err, TypeError) and isinstance(err, ValueError)
    assert "no signature" in text and "wrap it in a plain Python def" in text and "def attention(q, k, v)" in text
    assert err.__cause__ is None and err.__suppress_context__  # one error, not inspect's underneath


def test_names_that_an_opaque_signature_lacks_say_how_to_wrap_it() -> None:
    """An aten op's signature is ``(*args, **kwargs)``: a name is unknown, and the error says so."""
    with pytest.raises(GraphBreakError, match=r"name \['self'\], which are not parameters of it; parameters: "
                                              r"\['args', 'kwargs'\]; name those, or wrap it in a plain Python def"):
        graph_break(reads="self")(torch.ops.aten.mul.Tensor)


def test_the_wrapped_builtin_takes_names_and_keeps_them_by_alias() -> None:
    """What the error advises: a ``def`` naming the builtin's arguments, end to end."""
    @graph_break(reads=("q", "k", "v"))
    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v)

    x = torch.randn(8, 8)

    def forward(n: int) -> torch.Tensor:
        h = (x[:n] * 2).view(1, 1, n, 8)
        return attention(h, h + 1, h - 1) * 3

    _capture_and_replay(forward, x, "on")


@pytest.mark.parametrize(("fn", "names"), [
    (functools.partial(_sum3, c=0.5), {"reads": ("a", "b")}),
    (_Scale(3.0), {"reads": "a", "writes": "b"}),
    (_Scale(-2.0).mix, {"reads": ("a", "b")}),
    (operator.mul, {"reads": ("a", "b")}),  # a C function with a text signature, positional-only
])
def test_callables_with_a_signature_take_names(fn: Callable[..., Any], names: dict[str, Any]) -> None:
    brk = graph_break(**names)(fn)
    x = torch.randn(8, 4)
    _capture_and_replay(lambda n: _forward(brk, x, n), x, "on")


def test_a_number_a_break_returns_that_changes_at_replay_is_refused() -> None:
    """``math.fsum`` returns a float the forward scales by: at capture it is baked into the next
    segment, so a replay that computes another raises instead of returning a stale value."""
    fsum = graph_break(math.fsum)
    x = torch.randn(6, 3)

    def forward(n: int) -> torch.Tensor:
        h = x[:n] * 2
        return h * fsum(h[:, 0])

    backend = create_backend("breakable", options=BackendOptions(output_mode="on"))
    with torch.no_grad(), backend.capture_session():
        backend.capture_one(ShapeKey(6), lambda: forward(6), capture_inputs=x)
    got = backend.replay(ShapeKey(6))  # the same inputs: the same number, the same values
    with torch.no_grad():
        torch.testing.assert_close(got, forward(6))
    x.add_(1)
    with pytest.raises(RuntimeError, match=r"break fsum returned .* at output on replay, .* at capture: .*"
                                           r"return it as a tensor"):
        backend.replay(ShapeKey(6))
    backend.cleanup()


def test_plain_values_a_break_returns_unchanged_replay_and_a_changed_count_is_refused() -> None:
    calls: list[int] = []

    @graph_break
    def labelled(q: torch.Tensor) -> tuple[Any, ...]:
        calls.append(1)
        extra = ("more",) if len(calls) > 3 else ()
        return (q * 2, 7, "name", float("nan"), None, object(), *extra)

    x = torch.randn(4, 2)
    backend = create_backend("breakable", options=BackendOptions(output_mode="off", num_warmups=0))
    with torch.no_grad(), backend.capture_session():
        backend.capture_one(ShapeKey(4), lambda: labelled(x + 1)[0] + 1, capture_inputs=x)
    for _ in range(2):  # NaN equals NaN, a fresh object() is not compared
        x.add_(1)
        torch.testing.assert_close(backend.replay(ShapeKey(4)), (x + 1) * 2 + 1)
    with pytest.raises(RuntimeError, match=r"labelled returned 4 numbers or strings on replay, captured 3"):
        backend.replay(ShapeKey(4))
