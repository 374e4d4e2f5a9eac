"""Piecewise: one clear error where torch.compile's own would be a traceback or a silent no-op.

1. torch's own ops (aten) in ``splitting_ops``: dynamo's graph holds the torch functions a model
   calls (``torch.mm``, ``x @ w``, ``Tensor.softmax``), not the aten ops they dispatch to, so such
   an op never split (one piece, no word). Now the first call raises one
   :class:`PiecewiseCompileError` naming the op and the forms ``splitting_ops`` takes; an aten op
   the model calls itself (``torch.ops.aten.mm.default(...)``) still splits. A string is refused
   when the backend is made (:class:`SplittingOpError`).
2. A model whose shapes need something of the size (a multiple of 2, equal to another extent, not
   1) traced with the size unbacked or size-oblivious (the default ``"auto"``) made torch raise its
   own text at a later size ("Runtime assertion failed for expression ...", dynamo's "Guard failed
   on the same frame it was created. This is a bug", a fake-tensor ``TorchRuntimeError``). Now
   each is one :class:`PiecewiseCompileError` naming ``dynamic='backed'``, the key rolled back, the
   keys captured before still replaying; with ``dynamic="backed"`` the models that run eagerly at
   every size capture and replay eager after the inputs change.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from sglang_bcg_plugin import BackendOptions, ShapeKey, create_backend
from sglang_bcg_plugin.backends.piecewise import PiecewiseBackend, PiecewiseCompileError, SplittingOpError

from splitting_ops import mix  # tests/splitting_ops.py

W = torch.randn(6, 6, generator=torch.Generator().manual_seed(5))
SIZES = [12, 9, 4, 3, 1]  # largest first, odd and even, 1 included


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _piecewise(ops: list[Any] | None = None, mode: str = "on") -> PiecewiseBackend:
    backend = create_backend("piecewise", options=BackendOptions(output_mode=mode), splitting_ops=ops or [])
    assert isinstance(backend, PiecewiseBackend)
    return backend


# -- 1. torch's own ops in splitting_ops ------------------------------------------------------------------------------

MODELS_WITHOUT_ATEN_CALLS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "torch.mm": lambda x: torch.mm(torch.relu(x), W) + 1,
    "matmul operator": lambda x: (x * 2) @ W - 1,
    "linear": lambda x: torch.nn.functional.linear(x, W).tanh(),
    "softmax method": lambda x: (x + 1).softmax(-1) * 3,
    "torch.softmax": lambda x: torch.softmax(x * 2, dim=-1) + x,
}


@pytest.mark.parametrize("ops", [
    [torch.ops.aten.mm.default], [torch.ops.aten.mm], [torch.ops.aten.softmax.int], [torch.ops.aten.addmm.default],
    [mix, torch.ops.aten.mm.default],  # a custom op beside it changes nothing
], ids=["mm.default", "mm packet", "softmax.int", "addmm", "custom+aten"])
@pytest.mark.parametrize("model", sorted(MODELS_WITHOUT_ATEN_CALLS))
def test_an_aten_op_the_graph_never_calls_is_one_clear_error(ops: list[Any], model: str) -> None:
    backend = _piecewise(ops)
    fn = backend.compile(MODELS_WITHOUT_ATEN_CALLS[model])
    x = torch.randn(8, 6)
    with torch.no_grad(), backend.capture_session():
        with pytest.raises(PiecewiseCompileError) as info:
            backend.capture_one(ShapeKey(8), lambda: fn(x), capture_inputs=x)
    text = str(info.value)
    aten = next(op for op in ops if op is not mix)
    packet = str(aten if isinstance(aten, torch._ops.OpOverloadPacket) else aten.overloadpacket)
    assert f"torch's own op(s) {packet}, which the graph torch.compile traced never calls" in text
    assert "torch.library custom op" in text and "OpOverloadPacket" in text and "torch.ops.aten.<op>" in text
    assert "sglang_bcg_test" not in text  # the custom op is not blamed
    assert info.value.__suppress_context__  # one error, not dynamo's BackendCompilerFailed around it
    assert backend.captured_keys() == []


@pytest.mark.parametrize("op", [torch.ops.aten.mm.default, torch.ops.aten.mm])
def test_an_aten_op_the_model_calls_itself_splits_there(op: Any) -> None:
    def model(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten.mm.default(torch.relu(x) * 2, W) + 1

    backend = _piecewise([op])
    fn = backend.compile(model)
    x = torch.randn(12, 6)
    with torch.no_grad(), backend.capture_session():
        for n in SIZES:
            backend.capture_one(ShapeKey(n), lambda n=n: fn(x[:n]), capture_inputs=x)
    assert backend.num_segments(ShapeKey(12)) == 2
    assert backend.split_summaries[0].splitting_targets == ("aten.mm.default",)
    for _ in range(2):
        x.copy_(torch.randn(12, 6))
        for n in SIZES:
            got = backend.replay(ShapeKey(n))
            torch.testing.assert_close(got, model(x[:n]))


@pytest.mark.parametrize(("op", "hint"), [
    ("aten::mm", "torch.ops.aten.mm.default"), ("sglang_bcg_test::mix", "torch.ops.sglang_bcg_test.mix.default"),
    ("mm", "torch.ops.mm.<op>.default"),
])
def test_a_string_is_refused_when_the_backend_is_made(op: str, hint: str) -> None:
    with pytest.raises(SplittingOpError) as info:
        _piecewise([op])
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)
    text = str(info.value)
    assert f"splitting_ops[0] = {op!r} (str) is not a torch op" in text and hint in text
    assert "torch.library custom op" in text


# -- 2. shapes that need something of the size -----------------------------------------------------------------------

#: model -> the sizes of SIZES at which it runs eagerly
SHAPE_MODELS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], frozenset[int]]] = {
    # eager at every size: the last row broadcast over all
    "last row": (lambda x: torch.relu(x[-1:]).expand(x.shape[0], 6) - x, frozenset(SIZES)),
    # eager at every size: one row broadcast over all (dynamo asserts Min(1, u0) == u0 unbacked)
    "first row": (lambda x: x[:1].expand(x.shape[0], -1) * x + 1, frozenset(SIZES)),
    # eager at every size; unbacked, the padding's rows must match the input's
    "padded": (lambda x: x + x.new_ones((x.shape[0] % 2 + 2 * (x.shape[0] // 2) - x.shape[0] + 1, 6)),
               frozenset(SIZES)),
    # pairs of rows: eager fails at odd sizes
    "pairs": (lambda x: (x * 2).view(-1, 2, 6).sum(1), frozenset(n for n in SIZES if n % 2 == 0)),
    # the model's own check: eager fails below 4
    "checked": (lambda x: (torch._check(x.shape[0] >= 4), torch.tanh(x))[1], frozenset(n for n in SIZES if n >= 4)),
    # a fixed slice of the input: eager fails below 4
    "narrow": (lambda x: x.narrow(0, 1, 3) @ W, frozenset(n for n in SIZES if n >= 4)),
}


def _eager_runs(model: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, n: int) -> bool:
    try:
        model(x[:n])
    except (RuntimeError, IndexError):
        return False
    return True


@pytest.mark.parametrize("dynamic", ["auto", "unbacked", "size_oblivious"])
@pytest.mark.parametrize("name", sorted(SHAPE_MODELS))
def test_a_size_the_trace_assumed_away_is_one_error_naming_backed(name: str, dynamic: str) -> None:
    """Every size either captures and replays eager, or is refused with one error naming
    ``dynamic='backed'`` (rolled back; the keys before it still replay); never torch's raw text."""
    model, eager_sizes = SHAPE_MODELS[name]
    x = torch.randn(12, 6)
    assert {n for n in SIZES if _eager_runs(model, x, n)} == eager_sizes  # the table says the truth
    backend = _piecewise()
    fn = backend.compile(model, dynamic=dynamic)  # type: ignore[arg-type]
    captured, refused = [], []
    with torch.no_grad(), backend.capture_session():
        for n in SIZES:
            try:
                backend.capture_one(ShapeKey(n), lambda n=n: fn(x[:n]), capture_inputs=x)
            except PiecewiseCompileError as exc:
                text = str(exc)
                assert "dynamic='backed'" in text and "Dynamo's report" not in text.split("\n")[0]
                mode = "unbacked" if dynamic == "auto" else dynamic
                assert text.startswith(f"backend.compile(model): a call (capture size {n}) breaks what torch.compile "
                                       f"assumed of the size when it traced the model with its size dim {mode}"), text
                assert "This is a bug" not in text.split("Torch's report")[0]
                assert not backend.can_run(ShapeKey(n))
                refused.append(n)
            else:
                captured.append(n)
    assert set(SIZES) - eager_sizes <= set(refused)  # a size the model itself cannot take is never captured
    if dynamic != "size_oblivious" or name not in ("first row", "last row"):  # size-oblivious reasoning takes them
        assert refused, "the model trips an assumption of the symbolic trace (torch 2.13)"
    x.copy_(torch.randn(12, 6))
    for n in captured:
        torch.testing.assert_close(backend.replay(ShapeKey(n)), model(x[:n]))


@pytest.mark.parametrize("name", sorted(SHAPE_MODELS))
def test_backed_captures_what_runs_eagerly_and_names_the_models_own_error(name: str) -> None:
    """What the error advises: ``dynamic='backed'``. A size the model cannot take eagerly is one
    error quoting the model's own message, not a suggestion to pass ``backed`` again."""
    model, eager_sizes = SHAPE_MODELS[name]
    x = torch.randn(12, 6)
    backend = _piecewise(mode="released")
    fn = backend.compile(model, dynamic="backed")
    with torch.no_grad(), backend.capture_session():
        for n in SIZES:
            if n in eager_sizes:
                backend.capture_one(ShapeKey(n), lambda n=n: fn(x[:n]), capture_inputs=x)
                continue
            own = r"^backend.compile\(model\): (torch.compile could not trace the model \(|the model raised )RuntimeError"
            with pytest.raises(PiecewiseCompileError, match=own) as info:
                backend.capture_one(ShapeKey(n), lambda n=n: fn(x[:n]), capture_inputs=x)
            assert "dynamic='backed'" not in str(info.value)
    for _ in range(2):
        x.copy_(torch.randn(12, 6))
        for n in sorted(eager_sizes):
            torch.testing.assert_close(backend.replay(ShapeKey(n)), model(x[:n]))


def test_errors_that_are_no_size_assumption_pass_through() -> None:
    """A splitting op's own error at run time is the op's, not a compile error."""
    @torch.library.custom_op("sglang_bcg_test::refuses_odd", mutates_args=())
    def refuses_odd(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] % 2:
            msg = "odd rows are not served"
            raise RuntimeError(msg)
        return x * 2

    @refuses_odd.register_fake
    def _(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)

    backend = _piecewise([refuses_odd])
    fn = backend.compile(lambda x: refuses_odd(x + 1) - 1)
    x = torch.randn(12, 6)
    with torch.no_grad(), backend.capture_session():
        backend.capture_one(ShapeKey(12), lambda: fn(x), capture_inputs=x)
        with pytest.raises(RuntimeError, match="^odd rows are not served$") as info:
            backend.capture_one(ShapeKey(9), lambda: fn(x[:9]), capture_inputs=x)
    assert not isinstance(info.value, PiecewiseCompileError)


def test_a_direct_call_that_breaks_the_assumption_names_no_capture_size() -> None:
    model = SHAPE_MODELS["pairs"][0]
    fn = _piecewise().compile(model)
    assert fn(torch.randn(4, 6)).shape == (2, 6)
    with pytest.raises(PiecewiseCompileError, match=r"^backend.compile\(model\): a call breaks what torch.compile "
                                                    r"assumed of the size .* size dim unbacked"):
        fn(torch.randn(3, 6))


def test_other_compile_backend_failures_keep_dynamos_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang_bcg_plugin.backends.piecewise import compile as compile_module

    def broken(*args: Any, **kwargs: Any) -> Any:
        msg = "split failed"
        raise ValueError(msg)

    monkeypatch.setattr(compile_module, "split_graph", broken)
    fn = _piecewise().compile(lambda x: x * 2)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="split failed"):
        fn(torch.randn(4, 6))
