"""Piecewise on ordinary user code: a ``@graph_break`` attention, fixed-size tensor arguments.

1. The README's model, attention a ``@graph_break(reads=..., writes=...)`` function writing into
   ``out``, compiles under ``backend.compile(model)``: dynamo traces through the function as a
   plain call (the recorder lookup stays out of the traced region), so the pieces split only at
   registered splitting ops. The same model code captures under Full and Breakable. A
   ``@graph_break`` function whose body calls a registered splitting op splits there under
   Piecewise and breaks there under Breakable: one model, the same cut, both backends.
2. Only tensors whose size dim follows the capture size are marked dynamic: a ``[1]`` scale, a
   ``[1, 1, H]`` bias of a batch-first model, a fixed ``[H, H]`` weight, a 0-dim tensor and
   non-tensor arguments stay static (marked dynamic, a ``[1]`` scale made dynamo fail its own
   guard: "Guard failed on the same frame it was created"). Every ``dynamic`` mode compiles as
   often as for a model without them (once; ``"backed"``: once more for size 1).

Each case is a function of ``(device, engine)`` (plus its parameters);
``tests/gpu/test_piecewise_user_code_gpu.py`` runs them on real CUDA graphs and on the eager
engine with CUDA tensors. Replay is checked against eager after every input changed in place.
"""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from sglang_bcg_plugin import BackendOptions, ShapeKey, SharedOutputFallbackWarning, create_backend, graph_break
from sglang_bcg_plugin.backends.piecewise import PiecewiseBackend
from sglang_bcg_plugin.output.mode import mode_of_option

from splitting_ops import mix, write_softmax  # tests/splitting_ops.py

MODES: list[Any] = [False, True, "released"]
DYNAMIC = ["auto", "unbacked", "size_oblivious", "backed"]
SIZES = [16, 8, 5, 2, 1]  # largest first; 1 included: it must not recompile (but "backed")
H = 6  # no capture size: a fixed [H, H] weight never has the size's extent


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _piecewise(mode: Any, engine: str, ops: list[Any] | None = None, **kw: Any) -> PiecewiseBackend:
    backend = create_backend(
        "piecewise", options=BackendOptions(output_mode=mode_of_option(mode), engine=engine), splitting_ops=ops or [], **kw
    )
    assert isinstance(backend, PiecewiseBackend)
    return backend


def _compilations(dynamic: str, sizes: list[int]) -> int:
    """What a model with no fixed tensor compiles: once; ``"backed"`` specializes size 1."""
    return 2 if dynamic == "backed" and 1 in sizes else 1


def _replay_matches(backend: Any, sizes: list[int], refill: Callable[[], None], expected: Callable[[int], Any]) -> None:
    """Twice: every input changes in place, then each key's replay equals eager (checked right
    after it: released outputs of one partition share memory)."""
    for _ in range(2):
        refill()
        for s in sizes:
            got = backend.replay(ShapeKey(s))
            with torch.no_grad():
                want = expected(s)
            torch.testing.assert_close(got, want, msg=lambda m, s=s: f"size {s}: {m}")


# -- 1. a @graph_break attention ----------------------------------------------------------------
@graph_break(reads=("x",), writes=("out",))
def attention(x: torch.Tensor, out: torch.Tensor) -> None:
    """The README's attention: a plain Python function, eager between Breakable's segments."""
    out.copy_(torch.softmax(x, dim=-1))


@graph_break(reads=("x",), writes=("out",))
def op_attention(x: torch.Tensor, out: torch.Tensor) -> None:
    """The same attention through a registered custom op: Breakable breaks at this function,
    Piecewise splits at the op (``splitting_ops=[write_softmax]``)."""
    write_softmax(x, out)


class ReadmeModel(torch.nn.Module):
    def __init__(self, device: str, attn: Callable[[torch.Tensor, torch.Tensor], None] = attention) -> None:
        super().__init__()
        self.attn = attn
        self.register_buffer("w", torch.randn(16, 16, generator=torch.Generator().manual_seed(0)).to(device) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.w
        out = torch.empty_like(h)
        self.attn(h, out)
        return out @ self.w


def readme_model_case(name: str, mode: Any, device: str, engine: str, *, inductor: bool = False, split: bool = False) -> None:
    """The README's model captured by ``name``; Piecewise compiles it (default ``dynamic``)."""
    model = ReadmeModel(device, op_attention if split else attention)
    static = torch.randn(32, 16, device=device)
    sizes = [32, 16, 5, 1]
    if name == "piecewise":
        ops = [torch.ops.sglang_bcg_test.write_softmax.default] if split else []
        backend: Any = _piecewise(mode, engine, ops, inductor=inductor)
        fn: Callable[[torch.Tensor], torch.Tensor] = backend.compile(model)
    else:
        backend = create_backend(name, options=BackendOptions(output_mode=mode_of_option(mode), engine=engine))
        fn = model
    with torch.no_grad(), backend.capture_session():
        for s in sizes:
            backend.capture_one(ShapeKey(s), lambda s=s: fn(static[:s]), capture_inputs=static)
    if name == "piecewise":
        assert backend.num_compilations == 1
        # traced through: one piece; through a splitting op: split there, as Breakable breaks
        assert backend.num_segments(ShapeKey(16)) == (2 if split else 1)
    if name == "breakable":
        assert backend.num_segments(ShapeKey(16)) == 2
    # Inductor's numerics are the compiled callable's (docs/piecewise.md), eager's otherwise
    reference = fn if inductor else model
    _replay_matches(backend, sizes, lambda: static.copy_(torch.randn_like(static)), lambda s: reference(static[:s]))
    if name == "piecewise":
        assert backend.num_compilations == 1  # the direct calls compiled nothing either


@pytest.mark.parametrize("mode", MODES)
def test_readme_model_with_a_graph_break_attention_compiles_under_piecewise(mode: Any) -> None:
    readme_model_case("piecewise", mode, "cpu", "eager")


@pytest.mark.parametrize("mode", MODES)
def test_a_graph_break_around_a_splitting_op_splits_there_under_piecewise(mode: Any) -> None:
    readme_model_case("piecewise", mode, "cpu", "eager", split=True)


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="Inductor on CPU needs a C++ compiler")
@pytest.mark.parametrize("mode", [True, "released"])
def test_readme_model_with_inductor_pieces(mode: Any) -> None:
    readme_model_case("piecewise", mode, "cpu", "eager", inductor=True)


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["full", "breakable"])
def test_the_same_model_code_serves_full_and_breakable(name: str, mode: Any, split: bool) -> None:
    readme_model_case(name, mode, "cpu", "eager", split=split)


def test_graph_break_is_a_plain_call_under_any_torch_compile() -> None:
    """Outside our backend too: dynamo traces through it, no recorder lookup, no graph break."""
    x = torch.randn(4, 8)

    def f(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        attention(x * 2, out)
        return out + 1

    compiled = torch.compile(f, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), torch.softmax(x * 2, dim=-1) + 1)


# -- 2. fixed-size tensors beside the sized ones -------------------------------------------------
def fixed_scale_case(dynamic: str, mode: Any, device: str, engine: str) -> None:
    """The issue's case: ``fn(x[:s], scale)`` with ``scale = torch.tensor([3.0])``."""
    backend = _piecewise(mode, engine, [mix])
    fn = backend.compile(lambda x, scale: mix(x * scale) + 1.0, dynamic=dynamic)
    x, scale = torch.randn(16, H, device=device), torch.tensor([3.0], device=device)
    with torch.no_grad(), backend.capture_session():
        for s in SIZES:
            backend.capture_one(ShapeKey(s), lambda s=s: fn(x[:s], scale), capture_inputs=(x, scale))
    assert backend.num_compilations == _compilations(dynamic, SIZES)

    def refill() -> None:
        x.copy_(torch.randn_like(x))
        scale.copy_(torch.randn_like(scale))

    _replay_matches(backend, SIZES, refill, lambda s: torch.tanh(x[:s] * scale) + 2.0)


class BatchFirst(torch.nn.Module):
    """transformers' layout: ``[1, seq, H]`` activations, the size at dim 1."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.register_buffer("w", torch.randn(H, H, generator=torch.Generator().manual_seed(1)).to(device) / H)

    def forward(self, x: torch.Tensor, bias: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return mix(x @ self.w * scale + bias) * 2.0


def batch_first_case(dynamic: str, mode: Any, device: str, engine: str) -> None:
    """``dynamic_dim=1``: ``x[:, :s]`` of a ``[1, max, H]`` buffer is dynamic; a ``[1, 1, H]``
    bias (extent 1 at dim 1) and a ``[1]`` scale (no dim 1) stay static."""
    backend = _piecewise(mode, engine, [mix])
    model = BatchFirst(device)
    fn = backend.compile(model, dynamic=dynamic, dynamic_dim=1)
    x = torch.randn(1, 16, H, device=device)
    bias, scale = torch.randn(1, 1, H, device=device), torch.tensor([0.5], device=device)
    with torch.no_grad(), backend.capture_session():
        for s in SIZES:
            backend.capture_one(ShapeKey(s), lambda s=s: fn(x[:, :s], bias, scale), capture_inputs=(x, bias, scale))
    assert backend.num_compilations == _compilations(dynamic, SIZES)

    def refill() -> None:
        for t in (x, bias, scale):
            t.copy_(torch.randn_like(t))

    _replay_matches(backend, SIZES, refill, lambda s: model(x[:, :s], bias, scale))


class Mixed(torch.nn.Module):
    """Sized tensors (top level and in a list), a fixed weight, a 0-dim tensor, a dict holding a
    fixed bias, and non-tensor arguments."""

    def forward(
        self,
        x: torch.Tensor,
        pos: list[torch.Tensor],
        w: torch.Tensor,
        t0: torch.Tensor,
        factor: float,
        extra: dict[str, Any],
        *,
        flag: bool = False,
    ) -> torch.Tensor:
        h = (x @ w + pos[0][:, None]) * t0 * factor
        if flag:
            h = mix(h)
        return h + extra["bias"] * extra["k"]


def mixed_args_case(dynamic: str, mode: Any, device: str, engine: str) -> None:
    backend = _piecewise(mode, engine, [mix])
    model = Mixed()
    fn = backend.compile(model, dynamic=dynamic)
    x, pos = torch.randn(16, H, device=device), torch.randn(16, device=device)
    w, t0 = torch.randn(H, H, device=device), torch.tensor(0.5, device=device)
    extra = {"bias": torch.randn(H, device=device), "k": 3}

    def call(s: int) -> torch.Tensor:
        return fn(x[:s], [pos[:s]], w, t0, 2.0, extra, flag=True)

    with torch.no_grad(), backend.capture_session():
        for s in SIZES:
            backend.capture_one(ShapeKey(s), lambda s=s: call(s), capture_inputs=(x, pos, w, t0, extra["bias"]))
    assert backend.num_compilations == _compilations(dynamic, SIZES)
    assert backend.num_segments(ShapeKey(8)) == 2

    def refill() -> None:
        for t in (x, pos, w, t0, extra["bias"]):
            t.copy_(torch.randn_like(t))

    _replay_matches(backend, SIZES, refill, lambda s: model(x[:s], [pos[:s]], w, t0, 2.0, extra, flag=True))


def rows_per_size_case(dynamic: str, mode: Any, device: str, engine: str) -> None:
    """Rows a multiple of the key's size (speculative decoding's ``4 * size`` tokens): no tensor
    has the size itself, so the largest extent is the size dim; a ``[1]`` scale stays static."""
    backend = _piecewise(mode, engine, [mix])
    fn = backend.compile(lambda x, scale: mix(x * scale), dynamic=dynamic)
    x, scale = torch.randn(64, H, device=device), torch.tensor([2.0], device=device)
    sizes = [16, 8, 2, 1]
    with torch.no_grad(), backend.capture_session():
        for s in sizes:
            backend.capture_one(ShapeKey(s), lambda s=s: fn(x[: 4 * s], scale), capture_inputs=(x, scale))
    assert backend.num_compilations == 1  # 4 rows at size 1: nothing specializes

    def refill() -> None:
        x.copy_(torch.randn_like(x))
        scale.copy_(torch.randn_like(scale))

    _replay_matches(backend, sizes, refill, lambda s: torch.tanh(x[: 4 * s] * scale) + 1.0)


def _quiet(case: Callable[..., None], *args: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SharedOutputFallbackWarning)
        case(*args)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dynamic", DYNAMIC)
def test_a_fixed_size_tensor_argument_stays_static(dynamic: str, mode: Any) -> None:
    fixed_scale_case(dynamic, mode, "cpu", "eager")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dynamic", DYNAMIC)
def test_batch_first_inputs_beside_fixed_tensors(dynamic: str, mode: Any) -> None:
    batch_first_case(dynamic, mode, "cpu", "eager")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dynamic", DYNAMIC)
def test_several_inputs_some_fixed_some_not_tensors(dynamic: str, mode: Any) -> None:
    _quiet(mixed_args_case, dynamic, mode, "cpu", "eager")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dynamic", DYNAMIC)
def test_rows_a_multiple_of_the_size(dynamic: str, mode: Any) -> None:
    rows_per_size_case(dynamic, mode, "cpu", "eager")


@pytest.mark.parametrize("dynamic", DYNAMIC)
def test_direct_calls_infer_the_size_dim(dynamic: str) -> None:
    """Calls outside ``capture_one`` (no key size): the largest extent is the size; a call of
    size 1 marks what the calls before it marked, and a capture afterwards compiles nothing."""
    backend = _piecewise(True, "eager", [mix])
    fn = backend.compile(lambda x, scale: mix(x * scale) + 1.0, dynamic=dynamic)
    x, scale = torch.randn(16, H), torch.tensor([3.0])
    with torch.no_grad():
        for s in (16, 8, 1):
            torch.testing.assert_close(fn(x[:s], scale), torch.tanh(x[:s] * 3.0) + 2.0)
        with backend.capture_session():
            for s in (16, 8, 1):
                backend.capture_one(ShapeKey(s), lambda s=s: fn(x[:s], scale), capture_inputs=(x, scale))
    assert backend.num_compilations == _compilations(dynamic, [1])
    _replay_matches(backend, [16, 8, 1], lambda: x.copy_(torch.randn_like(x)), lambda s: torch.tanh(x[:s] * 3.0) + 2.0)


def test_a_first_call_of_size_one_marks_nothing() -> None:
    """Size 1 tells no sized dim from a broadcast one: the first call, at size 1, compiles static;
    the next size marks its sized tensors (one more compilation), then nothing recompiles."""
    backend = _piecewise(False, "eager", [mix])
    fn = backend.compile(lambda x, scale: mix(x * scale), dynamic="unbacked")
    x, scale = torch.randn(16, H), torch.tensor([3.0])
    with torch.no_grad():
        for s in (1, 16, 8, 1, 5):
            torch.testing.assert_close(fn(x[:s], scale), torch.tanh(x[:s] * 3.0) + 1.0)
    assert backend.num_compilations == 2


def test_capture_size_ignores_a_key_without_an_int_size() -> None:
    from sglang_bcg_plugin.backends.piecewise.compile import _capture_size, capture_size

    with capture_size(True):
        assert _capture_size.get() is None
    with capture_size(4), capture_size("4"):
        assert _capture_size.get() is None
    with capture_size(4):
        assert _capture_size.get() == 4
    assert _capture_size.get() is None


def test_a_call_without_sized_tensors_marks_nothing() -> None:
    backend = _piecewise(False, "eager", [mix])
    fn = backend.compile(lambda t, k: mix(t * k), dynamic="unbacked")
    t = torch.tensor(2.0)
    torch.testing.assert_close(fn(t, 3), torch.tanh(t * 3) + 1.0)
    assert fn.size_dims.marked([t, 3], torch.utils._pytree.tree_flatten(((t, 3), {}))[1]) == frozenset()


@graph_break
def _branchy(x: torch.Tensor) -> torch.Tensor:
    if x.sum() > 0:  # data-dependent control flow: dynamo cannot trace it as one graph
        return x * 2
    return x


def test_an_untraceable_graph_break_body_is_one_clear_error() -> None:
    from sglang_bcg_plugin.backends.piecewise import PiecewiseCompileError

    backend = _piecewise(False, "eager")
    fn = backend.compile(lambda x: _branchy(x) + 1)
    x = torch.randn(8, H)
    with torch.no_grad(), backend.capture_session():
        with pytest.raises(PiecewiseCompileError, match=r"(?s)could not \(Data-dependent branching\).*custom op and list it in splitting_ops.*_branchy") as info:
            backend.capture_one(ShapeKey(8), lambda: fn(x), capture_inputs=x)
    assert isinstance(info.value.__cause__, torch._dynamo.exc.Unsupported)
    assert backend.captured_keys() == []


def test_while_dynamo_traces_graph_break_never_looks_for_a_recorder(monkeypatch: pytest.MonkeyPatch) -> None:
    """What dynamo traces (its frames are not Python's, so coverage cannot see them): the plain
    call, before the ContextVar read dynamo cannot trace."""
    import sglang_bcg_plugin.breaks as breaks

    def no_lookup() -> None:
        raise AssertionError("active_recorder() read while compiling")

    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(breaks, "active_recorder", no_lookup)
    x, out = torch.randn(2, 3), torch.empty(2, 3)
    attention(x, out)
    torch.testing.assert_close(out, torch.softmax(x, dim=-1))


def _stock_llama() -> Any:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()  # stock "sdpa": transformers prepares the mask


@pytest.mark.parametrize("dynamic", ["auto", "unbacked"])
def test_a_size_dependent_guard_is_one_clear_error_naming_backed(dynamic: str) -> None:
    """transformers' mask preparation guards on the size (packed-sequence detection): traced with
    the size unbacked, dynamo cannot decide it. One error saying what to pass, nothing captured."""
    from sglang_bcg_plugin.backends.piecewise import PiecewiseCompileError

    model, ids = _stock_llama(), torch.randint(0, 100, (1, 16))
    backend = _piecewise(True, "eager")
    fn = backend.compile(model, dynamic=dynamic, dynamic_dim=1)
    with torch.no_grad(), backend.capture_session():
        with pytest.raises(PiecewiseCompileError, match=r"(?s)size dim unbacked .*dynamic='backed'.*Dynamo's report"):
            backend.capture_one(ShapeKey(16), lambda: fn(input_ids=ids, use_cache=False), capture_inputs=ids)
    assert backend.captured_keys() == []


@pytest.mark.parametrize("mode", MODES)
def test_stock_transformers_llama_compiles_backed_and_replays_eager(mode: Any) -> None:
    """What that error advises works: ``dynamic="backed"``, every size, after the ids changed."""
    model, ids = _stock_llama(), torch.randint(0, 100, (1, 16))
    backend = _piecewise(mode, "eager")
    fn = backend.compile(model, dynamic="backed", dynamic_dim=1)
    sizes = [16, 11, 8, 3, 1]
    with torch.no_grad(), backend.capture_session():
        for s in sizes:
            backend.capture_one(ShapeKey(s), lambda s=s: fn(input_ids=ids[:, :s], use_cache=False).logits,
                                capture_inputs=ids)
    _replay_matches(backend, sizes, lambda: ids.copy_(torch.randint(0, 100, ids.shape)),
                    lambda s: model(input_ids=ids[:, :s], use_cache=False).logits)


def test_other_dynamo_user_errors_keep_dynamos_report() -> None:
    backend = _piecewise(False, "eager")
    fn = backend.compile(lambda x: x + 1)
    error = torch._dynamo.exc.UserError(torch._dynamo.exc.UserErrorType.ANTI_PATTERN, "not this way")
    assert fn._why(error).startswith("backend.compile(model): torch.compile could not trace the model (not this way)")
    backed = backend.compile(lambda x: x + 1, dynamic="backed")
    guard = torch._dynamo.exc.UserError(torch._dynamo.exc.UserErrorType.DYNAMIC_CONTROL_FLOW, "data-dependent x")
    assert "dynamic='backed'" not in backed._why(guard) and "dynamic='backed'" in fn._why(guard)
