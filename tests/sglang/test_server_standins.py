"""The pure-torch ops of sglbundle's ``sgl_kernel`` stand-in against SGLang's own ``forward_native``.

The stand-in (``scripts/sglbundle/standins/sgl_kernel``) is loaded under a private module name,
never as ``sgl_kernel``: the other tests import SGLang, which must not see it. Loading it wraps
``torch.library.register_fake`` and adds a meta-path finder; the fixture undoes both.

Each op is compared with the ``forward_native`` of the SGLang layer that calls it on CUDA
(RMSNorm, GemmaRMSNorm, SiluAndMul, GeluAndMul, RotaryEmbedding; the same math in every release
0.5.13-0.5.23), with the in-place behaviour of sgl-kernel's Python wrappers; top-k / top-p
renorm against a direct per-row reference and their defining properties. Running each op on
``meta`` tensors (no data) shows it needs no host sync and no data-dependent shape, which is
what capturing it in a CUDA graph needs.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.sglang

ROOT = Path(__file__).resolve().parents[2]
STANDIN = ROOT / "scripts" / "sglbundle" / "standins" / "sgl_kernel"
PRIVATE = "_sglbundle_sgl_kernel_standin_under_test"

DTYPES = (torch.bfloat16, torch.float32)
#: bf16: a couple of units in the last place of values of order 1; fp32: torch's defaults.
TOL = {torch.bfloat16: {"atol": 2e-2, "rtol": 1.6e-2}, torch.float32: {"atol": 1e-5, "rtol": 1.3e-6}}


@contextlib.contextmanager
def loaded_standin() -> Iterator[ModuleType]:
    """The stand-in imported as ``PRIVATE``; on exit sys.modules, sys.meta_path and
    ``torch.library.register_fake`` are as they were."""
    register_fake = torch.library.register_fake
    finders = list(sys.meta_path)
    spec = importlib.util.spec_from_file_location(
        PRIVATE, STANDIN / "__init__.py", submodule_search_locations=[str(STANDIN)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[PRIVATE] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        for name in [n for n in sys.modules if n == PRIVATE or n.startswith(PRIVATE + ".")]:
            del sys.modules[name]
        sys.meta_path[:] = [f for f in sys.meta_path if any(f is g for g in finders)]
        torch.library.register_fake = register_fake


@pytest.fixture(scope="module")
def kernel() -> Iterator[ModuleType]:
    with loaded_standin() as module:
        yield module


class _Unset:
    """Server arguments / execution settings with every option unset, for releases whose layer
    constructors read them (0.5.13-0.5.16 raise "not set" in a bare process)."""

    rl_on_policy_target = None

    @property
    def deterministic(self) -> _Unset:
        return self

    def __getattr__(self, name: str) -> None:
        return None


_SETTINGS_GETTERS = ("get_global_server_args", "get_server_args", "get_exec")


@pytest.fixture
def build(monkeypatch: pytest.MonkeyPatch, kernel: ModuleType) -> Callable[..., Any]:
    """``build(cls, *args)``: an SGLang layer constructed as in a bare process on CPU."""

    def make(cls: type, *args: Any) -> Any:
        for klass in cls.__mro__:
            module = sys.modules.get(klass.__module__)
            for name in _SETTINGS_GETTERS:
                getter = getattr(module, name, None)
                if not callable(getter):
                    continue
                try:
                    getter()
                except Exception:  # noqa: BLE001 - "not set yet": give the constructor unset options
                    monkeypatch.setattr(module, name, _Unset)
        if importlib.util.find_spec("vllm") is None:
            # RotaryEmbedding on a machine that is neither CUDA nor SGLang's CPU engine binds
            # vllm's rotary_embedding as its fallback kernel (unused by forward_native). That
            # kernel's signature is the stand-in's.
            custom_ops = ModuleType("vllm._custom_ops")
            custom_ops.rotary_embedding = kernel.rotary_embedding  # type: ignore[attr-defined]
            monkeypatch.setitem(sys.modules, "vllm", ModuleType("vllm"))
            monkeypatch.setitem(sys.modules, "vllm._custom_ops", custom_ops)
        return cls(*args)

    return make


@pytest.fixture
def layers() -> SimpleNamespace:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # import-time warnings of SGLang on CPU, none ours
        from sglang.srt.layers.activation import GeluAndMul, SiluAndMul
        from sglang.srt.layers.layernorm import GemmaRMSNorm, RMSNorm
        from sglang.srt.layers.rotary_embedding import RotaryEmbedding
    return SimpleNamespace(
        RMSNorm=RMSNorm, GemmaRMSNorm=GemmaRMSNorm, SiluAndMul=SiluAndMul, GeluAndMul=GeluAndMul,
        RotaryEmbedding=RotaryEmbedding,
    )


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, **TOL[expected.dtype])


NORM_SHAPES = ((1, 8), (7, 131), (4, 1024), (2, 3, 67))


def _norm_case(
    build: Callable[..., Any], cls: type, shape: tuple[int, ...], dtype: torch.dtype, seed: int
) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden = shape[-1]
    layer = build(cls, hidden, 1e-5)
    weight = (torch.randn(hidden, generator=gen) * 0.5 + (1.0 if cls.__name__ == "RMSNorm" else 0.0)).to(dtype)
    layer.weight.data = weight
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    residual = torch.randn(shape, generator=gen).to(dtype)
    return layer, weight, x, residual


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=str)
@pytest.mark.parametrize("gemma", [False, True], ids=["rmsnorm", "gemma_rmsnorm"])
def test_rmsnorm_matches_forward_native(
    kernel: ModuleType, build: Callable[..., Any], layers: SimpleNamespace,
    gemma: bool, shape: tuple[int, ...], dtype: torch.dtype,
) -> None:
    cls = layers.GemmaRMSNorm if gemma else layers.RMSNorm
    op = kernel.gemma_rmsnorm if gemma else kernel.rmsnorm
    layer, weight, x, _ = _norm_case(build, cls, shape, dtype, seed=sum(shape))
    x0 = x.clone()
    expected = layer.forward_native(x.clone())

    got = op(x, weight, 1e-5)
    close(got, expected)
    assert torch.equal(x, x0), "without out=, input is left as it was"

    out = torch.full_like(x, float("nan"))
    returned = op(x, weight, 1e-5, out=out, enable_pdl=True)
    assert returned is out, "with out=, the op returns out itself"
    close(out, expected)
    assert torch.equal(x, x0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=str)
@pytest.mark.parametrize("gemma", [False, True], ids=["fused_add_rmsnorm", "gemma_fused_add_rmsnorm"])
def test_fused_add_rmsnorm_writes_input_and_residual(
    kernel: ModuleType, build: Callable[..., Any], layers: SimpleNamespace,
    gemma: bool, shape: tuple[int, ...], dtype: torch.dtype,
) -> None:
    cls = layers.GemmaRMSNorm if gemma else layers.RMSNorm
    op = kernel.gemma_fused_add_rmsnorm if gemma else kernel.fused_add_rmsnorm
    layer, weight, x, residual = _norm_case(build, cls, shape, dtype, seed=7 + sum(shape))
    expected_out, expected_residual = layer.forward_native(x.clone(), residual.clone())
    x_ptr, r_ptr, w0 = x.data_ptr(), residual.data_ptr(), weight.clone()

    assert op(x, residual, weight, 1e-5, enable_pdl=False) is None
    close(x, expected_out)  # input now holds the normalized sum
    close(residual, expected_residual)  # residual now holds input + residual
    assert (x.data_ptr(), residual.data_ptr()) == (x_ptr, r_ptr)
    assert torch.equal(weight, w0)


def test_norms_reject_a_weight_of_the_wrong_size(kernel: ModuleType) -> None:
    x = torch.randn(3, 16)
    with pytest.raises(ValueError, match=r"weight must have shape \(16,\)"):
        kernel.rmsnorm(x, torch.ones(15))
    with pytest.raises(ValueError, match="out must have shape"):
        kernel.rmsnorm(x, torch.ones(16), out=torch.empty(3, 15))
    with pytest.raises(ValueError, match="residual must have shape"):
        kernel.fused_add_rmsnorm(x, torch.randn(3, 1), torch.ones(16))


ACT_SHAPES = ((1, 16), (5, 2 * 67), (9, 2 * 512), (2, 3, 2 * 129))
ACTS = {
    "silu_and_mul": ("SiluAndMul", ()),
    "gelu_and_mul": ("GeluAndMul", ("none",)),
    "gelu_tanh_and_mul": ("GeluAndMul", ("tanh",)),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", ACT_SHAPES, ids=str)
@pytest.mark.parametrize("name", list(ACTS))
def test_act_and_mul_matches_forward_native(
    kernel: ModuleType, build: Callable[..., Any], layers: SimpleNamespace,
    name: str, shape: tuple[int, ...], dtype: torch.dtype,
) -> None:
    cls_name, args = ACTS[name]
    layer = build(getattr(layers, cls_name), *args)
    op = getattr(kernel, name)
    gen = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(shape, generator=gen) * 2).to(dtype)
    x0 = x.clone()
    expected = layer.forward_native(x.clone())

    close(op(x), expected)
    out = torch.full(expected.shape, float("nan"), dtype=dtype)
    assert op(x, out) is out
    close(out, expected)
    assert torch.equal(x, x0), "input is never written"


def test_act_and_mul_rejects_bad_shapes(kernel: ModuleType) -> None:
    with pytest.raises(ValueError, match="must be even"):
        kernel.silu_and_mul(torch.randn(2, 7))
    with pytest.raises(ValueError, match=r"out must have shape \(2, 4\)"):
        kernel.gelu_and_mul(torch.randn(2, 8), torch.empty(2, 8))


ROPE_DIMS = ((64, 64), (128, 64), (80, 32))  # (head_size, rotary_dim): full and partial rotary


def _rope_case(
    build: Callable[..., Any], layers: SimpleNamespace, head_size: int, rotary_dim: int, is_neox: bool,
    dtype: torch.dtype, tokens: int = 11,
) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
    rope = build(layers.RotaryEmbedding, head_size, rotary_dim, 512, 10000, is_neox, torch.float32)
    gen = torch.Generator().manual_seed(head_size + rotary_dim + int(is_neox))
    positions = torch.randint(0, 512, (tokens,), generator=gen)
    query = torch.randn(tokens, 3 * head_size, generator=gen).to(dtype)
    key = torch.randn(tokens, 1 * head_size, generator=gen).to(dtype)
    return rope, positions, query, key


def _heads(x: torch.Tensor, head_size: int) -> torch.Tensor:
    return x.reshape(x.shape[0], -1, head_size)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dims", ROPE_DIMS, ids=str)
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_rotary_embedding_matches_forward_native_in_place(
    kernel: ModuleType, build: Callable[..., Any], layers: SimpleNamespace,
    is_neox: bool, dims: tuple[int, int], dtype: torch.dtype,
) -> None:
    head_size, rotary_dim = dims
    rope, positions, query, key = _rope_case(build, layers, head_size, rotary_dim, is_neox, dtype)
    assert rope.cos_sin_cache.shape == (512, rotary_dim)
    expected_q, expected_k = rope.forward_native(positions, query.clone(), key.clone())
    q0 = query.clone()

    for cache in (rope.cos_sin_cache, rope.cos_sin_cache.to(dtype)):  # fp32 (CUDA) or query dtype
        q, k = q0.clone(), key.clone()
        ptrs = (q.data_ptr(), k.data_ptr())
        assert kernel.rotary_embedding(positions, q, k, head_size, cache, is_neox) is None
        close(q, expected_q)
        close(k, expected_k)
        assert (q.data_ptr(), k.data_ptr()) == ptrs
        # the dimensions past rotary_dim pass through untouched
        assert torch.equal(_heads(q, head_size)[..., rotary_dim:], _heads(q0, head_size)[..., rotary_dim:])

    q = q0.clone()  # without a key, int32 positions, [tokens, heads, head_size] layout
    kernel.rotary_embedding(positions.int(), _heads(q, head_size), None, head_size, rope.cos_sin_cache, is_neox)
    close(q, expected_q)


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_rotary_embedding_writes_through_strided_views(
    kernel: ModuleType, build: Callable[..., Any], layers: SimpleNamespace, is_neox: bool
) -> None:
    """q and k split from one packed qkv (SGLang's layout) are rotated in the packed tensor."""
    head_size, rotary_dim = 128, 64
    rope, positions, query, key = _rope_case(build, layers, head_size, rotary_dim, is_neox, torch.bfloat16)
    value = torch.randn_like(key)
    qkv = torch.cat([query, key, value], dim=-1)
    q, k, v = qkv.split([query.shape[-1], key.shape[-1], value.shape[-1]], dim=-1)
    assert not q.is_contiguous()
    expected_q, expected_k = rope.forward_native(positions, query.clone(), key.clone())

    kernel.rotary_embedding(positions, q, k, head_size, rope.cos_sin_cache, is_neox)
    close(qkv[:, : query.shape[-1]], expected_q)
    close(qkv[:, query.shape[-1] : query.shape[-1] + key.shape[-1]], expected_k)
    assert torch.equal(v, value)

    # a layout no view can split (heads interleaved across tokens): rotated, written back whole
    qt = query.clone().t().contiguous().t()
    kernel.rotary_embedding(positions, qt, None, head_size, rope.cos_sin_cache, is_neox)
    close(qt, expected_q)


def test_rotary_embedding_checks_shapes(kernel: ModuleType) -> None:
    cache = torch.randn(16, 8)
    positions = torch.arange(4)
    with pytest.raises(ValueError, match="is not"):
        kernel.rotary_embedding(positions, torch.randn(4, 30), None, 16, cache)
    with pytest.raises(ValueError, match="exceeds head_size"):
        kernel.rotary_embedding(positions, torch.randn(4, 24), None, 4, cache)
    empty = torch.empty(0, 32)
    kernel.rotary_embedding(torch.empty(0, dtype=torch.long), empty, empty.clone(), 16, cache)


# --- top-k / top-p renorm ---------------------------------------------------------------------


def _probs(rows: int, vocab: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(rows, vocab, generator=gen) * 2, dim=-1).to(dtype)


def _renorm_rows(probs: torch.Tensor, keep_count: Callable[[list[float], int], int]) -> torch.Tensor:
    """Per row: keep the ``keep_count(sorted_row, row_index)`` largest and every value equal to
    the last of them (ties at the cut), renormalize (float64)."""
    out = torch.zeros(probs.shape, dtype=torch.float64)
    for i, row in enumerate(probs.double()):
        values, order = row.sort(descending=True)
        listed = values.tolist()
        n = keep_count(listed, i)
        while n < len(listed) and listed[n] == listed[n - 1]:
            n += 1
        out[i, order[:n]] = values[:n] / values[:n].sum()
    return out


def _topk_count(ks: list[int], vocab: int) -> Callable[[list[float], int], int]:
    return lambda _values, i: vocab if ks[i] <= 0 else min(ks[i], vocab)


VOCABS = (7, 33, 1000)


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_top_k_renorm(kernel: ModuleType, vocab: int, dtype: torch.dtype) -> None:
    probs = _probs(6, vocab, seed=vocab, dtype=dtype)
    p0 = probs.clone()
    for top_k in (1, 3, vocab - 1, vocab, vocab + 5, 0):
        got = kernel.top_k_renorm_prob(probs, top_k)
        assert got.dtype == torch.float32 and got.shape == probs.shape
        expected = _renorm_rows(probs.float(), _topk_count([top_k] * 6, vocab))
        torch.testing.assert_close(got.double(), expected, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(got.sum(-1), torch.ones(6), atol=1e-5, rtol=0)
        kept = vocab if top_k <= 0 else min(top_k, vocab)
        if dtype == torch.float32:  # distinct probabilities (bf16 rounding may tie some)
            assert (got > 0).sum(-1).tolist() == [kept] * 6
    ks = [1, 2, 5, vocab, 0, 3]
    for k_tensor in (torch.tensor(ks), torch.tensor(ks, dtype=torch.int32)):
        got = kernel.top_k_renorm_probs(probs, k_tensor)
        torch.testing.assert_close(got.double(), _renorm_rows(probs.float(), _topk_count(ks, vocab)), atol=1e-6, rtol=1e-5)
    assert torch.equal(probs, p0), "probs is never written"


def test_top_k_renorm_keeps_ties_at_the_cut(kernel: ModuleType) -> None:
    probs = torch.tensor([[0.3, 0.1, 0.2, 0.2, 0.2]])
    got = kernel.top_k_renorm_prob(probs, 2)
    torch.testing.assert_close(got, torch.tensor([[0.3, 0.0, 0.2, 0.2, 0.2]]) / 0.9)


def _topp_count(ps: list[float]) -> Callable[[list[float], int], int]:
    def count(values: list[float], i: int) -> int:
        total = 0.0
        for n, value in enumerate(values, start=1):
            total += value
            if total >= ps[i]:
                return n
        return len(values)

    return count


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_top_p_renorm(kernel: ModuleType, vocab: int, dtype: torch.dtype) -> None:
    probs = _probs(5, vocab, seed=100 + vocab, dtype=dtype)
    p0 = probs.clone()
    for top_p in (1e-9, 0.3, 0.5, 0.9, 1.0):
        got = kernel.top_p_renorm_prob(probs, top_p)
        assert got.dtype == torch.float32 and got.shape == probs.shape
        expected = _renorm_rows(probs.float(), _topp_count([top_p] * 5))
        torch.testing.assert_close(got.double(), expected, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(got.sum(-1), torch.ones(5), atol=1e-5, rtol=0)
        for row, kept in zip(probs.double(), got > 0):
            # the smallest prefix of the sorted row reaching top_p: its mass reaches top_p
            # (or it is the whole row), and without its smallest members (ties) it does not
            mass = row[kept].sum().item()
            assert mass >= min(top_p, row.sum().item()) - 1e-6
            smallest = row[kept].min()
            assert mass - row[kept & (row == smallest)].sum().item() < top_p
        if top_p == 1e-9:
            assert (got > 0).sum(-1).tolist() == [1] * 5, "the largest probability is always kept"
    ps = [0.2, 0.5, 0.7, 0.95, 1.0]
    got = kernel.top_p_renorm_probs(probs, torch.tensor(ps))
    torch.testing.assert_close(got.double(), _renorm_rows(probs.float(), _topp_count(ps)), atol=1e-6, rtol=1e-5)
    assert torch.equal(probs, p0), "probs is never written"


# --- no host sync, no data-dependent shape: every op runs on meta tensors ---------------------


def test_every_op_runs_on_meta_tensors(kernel: ModuleType) -> None:
    """A meta tensor has no data: an op that read a value on the host (``.item()``, a
    data-dependent shape) would fail here, and could not be captured in a CUDA graph either."""
    meta = {"device": "meta", "dtype": torch.bfloat16}
    x, residual, w = torch.empty(5, 96, **meta), torch.empty(5, 96, **meta), torch.empty(96, **meta)
    assert kernel.rmsnorm(x, w).shape == (5, 96)
    assert kernel.gemma_rmsnorm(x, w, out=torch.empty_like(x)).device.type == "meta"
    kernel.fused_add_rmsnorm(x, residual, w)
    kernel.gemma_fused_add_rmsnorm(x, residual, w)
    for name in ACTS:
        assert getattr(kernel, name)(x).shape == (5, 48)
    positions = torch.empty(5, dtype=torch.long, device="meta")
    q, k = torch.empty(5, 4 * 24, **meta), torch.empty(5, 24, **meta)
    kernel.rotary_embedding(positions, q, k, 24, torch.empty(64, 16, device="meta"), False)
    probs = torch.empty(5, 50, device="meta")
    assert kernel.top_k_renorm_prob(probs, torch.empty(5, dtype=torch.int32, device="meta")).shape == (5, 50)
    assert kernel.top_k_renorm_prob(probs, 4).dtype == torch.float32
    assert kernel.top_p_renorm_prob(probs, torch.empty(5, device="meta")).shape == (5, 50)
    assert kernel.top_p_renorm_prob(probs, 0.9).shape == (5, 50)


# --- the rest of the stand-in is as it was ----------------------------------------------------


def test_real_names_and_placeholders(kernel: ModuleType) -> None:
    for name in ("rmsnorm", "fused_add_rmsnorm", "gemma_rmsnorm", "gemma_fused_add_rmsnorm", "silu_and_mul",
                 "gelu_and_mul", "gelu_tanh_and_mul", "rotary_embedding", "top_k_renorm_prob", "top_p_renorm_prob"):
        assert getattr(kernel, name) is getattr(kernel._torch_ops, name)
    with pytest.raises(NotImplementedError, match="apply_rope_with_cos_sin_cache_inplace is not available"):
        kernel.apply_rope_with_cos_sin_cache_inplace()
    kvcacheio = importlib.import_module(PRIVATE + ".kvcacheio")
    with pytest.raises(NotImplementedError, match="stand-in"):
        kvcacheio.transfer_kv_all_layer()
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(PRIVATE + ".allreduce")
    t = torch.arange(12.0).reshape(3, 4)[:, 1:]
    ref = kernel.weak_ref_tensor(t)
    assert (ref.data_ptr(), ref.shape, ref.stride()) == (t.data_ptr(), t.shape, t.stride())


def test_utils(kernel: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    utils = importlib.import_module(PRIVATE + ".utils")
    assert kernel.utils is utils
    from_import: dict[str, Any] = {}
    exec(f"from {PRIVATE}.utils import is_arch_support_pdl, get_cuda_stream", from_import)  # noqa: S102
    assert from_import["is_arch_support_pdl"] is utils.is_arch_support_pdl

    monkeypatch.setattr(utils, "_pdl", [])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for capability, expected in (((9, 0), True), ((8, 6), False), ((10, 0), True)):
        utils._pdl.clear()
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _d, c=capability: c)
        assert utils.is_arch_support_pdl() is expected
        assert utils.is_arch_support_pdl() is expected  # cached
    utils._pdl.clear()

    def no_cuda(_device: int) -> tuple[int, int]:
        raise RuntimeError("no CUDA device")

    monkeypatch.setattr(torch.cuda, "get_device_capability", no_cuda)
    assert utils.is_arch_support_pdl() is False

    monkeypatch.setattr(torch.cuda, "current_stream", lambda: SimpleNamespace(cuda_stream=1234))
    assert utils.get_cuda_stream() == 1234
    assert utils._to_tensor_scalar_tuple(3) == (None, 3)
    t = torch.ones(2)
    assert utils._to_tensor_scalar_tuple(t)[0] is t
    with pytest.raises(NotImplementedError, match="utils.something_else is not available"):
        utils.something_else()


def test_loading_the_standin_leaves_the_process_as_it_was() -> None:
    register_fake, finders = torch.library.register_fake, list(sys.meta_path)
    before = set(sys.modules)
    with loaded_standin() as module:
        assert getattr(torch.library.register_fake, "__sglbundle_standin__", False)  # its wrapper
        assert module.rmsnorm.__module__ == PRIVATE + "._torch_ops"
    assert torch.library.register_fake is register_fake
    assert sys.meta_path == finders
    assert not {n for n in set(sys.modules) - before if n.startswith(PRIVATE)}
    assert "sgl_kernel" not in sys.modules or not getattr(sys.modules["sgl_kernel"], "__sglbundle_standin__", False)
