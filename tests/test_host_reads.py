"""Never a stale value from a host read, never a stale tensor on an output attribute.

1. A forward that reads a tensor's value on the host while a segment is open (``.item()``,
   ``bool(t)``, ``if t > 0:``, ``.tolist()``, ``torch.equal``, ``nonzero``, ``x[mask]``) is
   refused at capture with :class:`HostReadError` naming the op, the key and the segment, on the
   eager segments as on CUDA (where the stream capture raises); the key is rolled back and the
   backend stays usable. Reads in a ``@graph_break`` body or a warmup are fine.
2. transformers' ``LlamaModel`` with its stock ``"sdpa"`` attention: on the eager engine its mask
   check is refused with a message that says what to do; a prepared 4D mask, or attention through
   a ``@graph_break`` function, replays the mask's new values.
3. A tensor on an attribute the output walk does not follow (a dataclass's non-field attribute,
   an instance attribute of a dict subclass or a ``tensors`` holder) is a ``TypeError`` at
   capture on every backend, mode and sharing setting; plain values there stay allowed.
4. A property: over forwards that read values, inputs changed in place and attributes set on
   outputs, every replay equals the eager forward on the changed inputs, or capture raised one
   of the documented errors.

Each case is a function of ``(device, engine)``; ``tests/gpu/test_host_reads_gpu.py`` runs them
on real CUDA graphs and on the eager engine over CUDA tensors.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_bcg_plugin import BackendOptions, HostReadError, ShapeKey, create_backend, graph_break
from sglang_bcg_plugin.output.policy import SharedOutputFallbackWarning
from splitting_ops import write_softmax

MODES = ["off", "on", "released"]
READS = ["item", "bool", "if", "tolist", "numpy", "equal", "nonzero", "masked_select", "mask_index", "caught"]

#: What the eager tape names for each read (CUDA names the stream capture's error instead).
OP_TEXT = {
    "item": "_local_scalar_dense", "bool": "_local_scalar_dense", "if": "_local_scalar_dense",
    "tolist": "Tensor.tolist()", "numpy": "Tensor.numpy()", "equal": "aten.equal",
    "nonzero": "aten.nonzero", "masked_select": "aten.masked_select", "mask_index": "boolean mask",
    "caught": "_local_scalar_dense",
}


def _backend(name: str, mode: str, engine: str, **opts: Any) -> Any:
    kwargs: dict[str, Any] = {}
    if name == "piecewise":
        kwargs["splitting_ops"] = [torch.ops.sglang_bcg_test.write_softmax.default]
    return create_backend(name, options=BackendOptions(output_mode=mode, engine=engine, **opts), **kwargs)


def read_value(x: torch.Tensor, read: str) -> float:
    """A Python number that depends on ``x``'s values, read on the host as ``read`` says."""
    if read == "item":
        return x.abs().max().item()
    if read == "bool":
        return 2.0 if bool(x[0, 0] > 0) else 3.0
    if read == "if":
        if x[0, 0] > 0:
            return 2.0
        return 3.0
    if read == "tolist":
        return float(x.tolist()[0][0])
    if read == "numpy":
        return float(x.numpy(force=True)[0, 0])
    if read == "equal":
        return 2.0 if torch.equal(x, x.abs()) else 3.0
    if read == "nonzero":
        return float((x > 0).nonzero().shape[0])
    if read == "masked_select":
        return float(x.masked_select(x > 0).numel())
    if read == "mask_index":
        return float(x[x > 0].numel())
    assert read == "caught"
    try:  # a forward that swallows the error: the segment stays failed, as a stream capture does
        return x.abs().max().item()
    except RuntimeError:
        return 1.0


@graph_break(reads="h", writes="out")
def _softmax_into(h: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(torch.softmax(h, dim=-1))


@graph_break(reads="h")
def _scale_by_max(h: torch.Tensor) -> torch.Tensor:
    """A host read inside a break body: eager at every replay, so it follows the input."""
    return h * h.abs().max().item()


class _Attn(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        write_softmax(x * 2, out)
        return out + 1


def _forward(name: str, x: torch.Tensor, read: str, where: str) -> Callable[[int, Any], torch.Tensor]:
    """A forward of backend ``name`` that reads ``x`` on the host ``where``: ``"before"`` the
    first break (or the compiled callable), ``"after"`` it, or ``"none"``."""

    def forward(n: int, compiled: Callable[..., Any]) -> torch.Tensor:
        s = read_value(x, read) if where == "before" else 1.0
        h = x[:n] * s
        if name == "breakable":
            out = torch.empty_like(h)
            _softmax_into(h, out)
        elif name == "piecewise":
            out = compiled(h)
        else:
            out = torch.softmax(h, dim=-1)
        t = read_value(x, read) if where == "after" else 1.0
        return out * t

    return forward


def host_read_case(name: str, read: str, where: str, mode: str, device: str, engine: str) -> None:
    """A host read inside a segment is refused (op, key, segment), the key rolled back, the
    backend still usable; Full's eager engine re-runs the forward, so its replay is right."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 4, generator=g).to(device)
    backend = _backend(name, mode, engine)
    compiled = backend.compile(_Attn()) if name == "piecewise" else None
    forward = _forward(name, x, read, where)
    key = ShapeKey(8)
    refused = not (name == "full" and engine == "eager")
    with torch.no_grad(), backend.capture_session():
        if refused:
            with pytest.raises(HostReadError) as info:
                backend.capture_one(key, lambda: forward(8, compiled), capture_inputs=x)
            err = info.value
            assert err.shape_key == key and repr(key) in str(err)
            text = str(err)
            assert "read a tensor's value on the host" in text and "@graph_break" in text
            if name == "full":
                assert err.segment is None and "inside its graph" in text
            else:  # the read before the break (or split) is in segment 0, after it in segment 1
                expected = 0 if where == "before" else 1
                assert err.segment == expected and f"segment {expected}" in text, text
            if engine == "eager":
                assert OP_TEXT[read] in text, text
                assert "test_host_reads.py" in text  # the user's line
            assert not backend.can_run(key)  # rolled back
            if device == "cuda":  # the generators left capture mode: a random op runs eagerly
                assert torch.rand(2, device=device).shape == (2,)
            backend.capture_one(key, lambda: _clean(name, x, compiled), capture_inputs=x)  # usable
            reference: Callable[[], torch.Tensor] = lambda: _clean(name, x, compiled)
        else:
            backend.capture_one(key, lambda: forward(8, compiled), capture_inputs=x)
            reference = lambda: forward(8, compiled)
    for _ in range(2):
        x.copy_(torch.randn(8, 4, generator=g).to(device))
        got = backend.replay(key)
        with torch.no_grad():
            torch.testing.assert_close(got, reference())
    backend.cleanup()
    torch._dynamo.reset()


def _clean(name: str, x: torch.Tensor, compiled: Any) -> torch.Tensor:
    """The same forward without a host read: what the backend captures after the refusal."""
    return _forward(name, x, "item", "none")(8, compiled)


def break_read_case(mode: str, device: str, engine: str) -> None:
    """A host read inside a ``@graph_break`` body (eager at every replay) follows the input;
    a read during the warmups only is fine too."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, 4, generator=g).to(device)
    calls = {"n": 0}

    def forward(n: int) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] <= 2:  # the warmups read on the host (eager, before any segment)
            assert x.abs().max().item() >= 0
        return _scale_by_max(x[:n] * 2) + 1

    backend = _backend("breakable", mode, engine, num_warmups=2)
    with torch.no_grad(), backend.capture_session():
        backend.capture_one(ShapeKey(8), lambda: forward(8), capture_inputs=x)
        backend.capture_one(ShapeKey(4), lambda: forward(4), capture_inputs=x)
    for _ in range(2):
        x.copy_(torch.randn(8, 4, generator=g).to(device) * 3)
        for n in (8, 4):
            got = backend.replay(ShapeKey(n))
            with torch.no_grad():
                torch.testing.assert_close(got, _scale_by_max(x[:n] * 2) + 1)


# -- item 2: transformers' LlamaModel --------------------------------------------------------


def _llama(attention: str, device: str) -> Any:
    transformers = pytest.importorskip("transformers")
    from sglang_bcg_plugin.bench.workload import register_attention

    register_attention()
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=256, use_cache=False,
    )
    config._attn_implementation = attention
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return transformers.LlamaModel(config).eval().to(device)


def _left_pad(mask: torch.Tensor, pad: int) -> None:
    """Left padding in place: the first ``pad`` positions are masked out."""
    mask.fill_(1)
    mask[..., :pad] = 0


def llama_sdpa_mask_case(mask_kind: str, mode: str, device: str, engine: str) -> None:
    """Stock ``"sdpa"``: transformers reads the 2D mask (or, with no mask, the position ids) on
    the host. The eager engine refuses it with a message saying what to do; under a real CUDA
    stream capture transformers sees the capture, builds the mask on the device and replays
    the mask's new values."""
    model = _llama("sdpa", device)
    n = 16
    ids = torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(3)).to(device)
    mask = torch.ones(1, n, dtype=torch.long, device=device)
    kwargs = {"attention_mask": mask} if mask_kind == "2d" else {}

    def forward() -> Any:
        return model(input_ids=ids, use_cache=False, **kwargs)

    backend = _backend("breakable", mode, engine)
    with torch.no_grad(), backend.capture_session():
        if engine == "eager":
            with pytest.raises(HostReadError) as info:
                backend.capture_one(ShapeKey(n), forward, capture_inputs=(ids, mask))
            text = str(info.value)
            assert "transformers" in text and "masking_utils.py" in text
            assert "position ids" in text and "4D boolean mask" in text and "@graph_break" in text
            assert "AttentionInterface" in text
            assert not backend.can_run(ShapeKey(n))
            return
        captured = backend.capture_one(ShapeKey(n), forward, capture_inputs=(ids, mask)).last_hidden_state.clone()
    _left_pad(mask, 3)
    got = backend.replay(ShapeKey(n)).last_hidden_state
    with torch.no_grad():
        ref = forward().last_hidden_state
    torch.testing.assert_close(got, ref, equal_nan=True)
    if mask_kind == "2d":
        assert not torch.allclose(captured, ref)  # the mask change mattered


def llama_4d_mask_case(attention: str, mode: str, device: str, engine: str) -> None:
    """A prepared 4D boolean mask (transformers passes it as it is, reading nothing on the host)
    with stock ``"sdpa"``, or attention through a ``@graph_break`` function: replay follows the
    mask changed in place (left padding)."""
    model = _llama(attention, device)
    n = 16
    ids = torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(4)).to(device)
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    mask = causal[None, None].clone()

    def forward() -> Any:
        return model(input_ids=ids, attention_mask=mask, use_cache=False)

    backend = _backend("breakable", mode, engine)
    with torch.no_grad(), backend.capture_session():
        captured = backend.capture_one(ShapeKey(n), forward, capture_inputs=(ids, mask)).last_hidden_state.clone()
    pad = 3  # left padding: no query attends a padded key; padded queries attend themselves
    mask.copy_(causal)
    mask[..., :, :pad] = False
    mask[..., torch.arange(pad), torch.arange(pad)] = True
    got = backend.replay(ShapeKey(n)).last_hidden_state
    with torch.no_grad():
        ref = forward().last_hidden_state
    torch.testing.assert_close(got, ref)
    assert not torch.allclose(captured, ref)


# -- item 3: tensors on attributes the walk does not follow ----------------------------------


@dataclasses.dataclass
class Out:
    y: torch.Tensor


class OutDict(dict):  # type: ignore[type-arg]
    pass


class Proxy:
    """Holds its tensors in a ``tensors`` dict (SGLang's ``PPProxyTensors``)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors


KINDS = ["dataclass", "dict", "holder", "model_output"]


def _wrap(kind: str, y: torch.Tensor) -> Any:
    if kind == "dataclass":
        return Out(y)
    if kind == "dict":
        return OutDict(y=y)
    if kind == "holder":
        return Proxy({"y": y})
    from transformers.modeling_outputs import BaseModelOutputWithPast

    return BaseModelOutputWithPast(last_hidden_state=y)


def _leaf(kind: str, out: Any) -> torch.Tensor:
    if kind == "dataclass":
        return out.y  # type: ignore[no-any-return]
    if kind == "holder":
        return out.tensors["y"]  # type: ignore[no-any-return]
    return out["last_hidden_state" if kind == "model_output" else "y"]  # type: ignore[no-any-return]


def extra_attribute_case(name: str, kind: str, extra: str, mode: str, device: str, engine: str) -> None:
    """``o.extra = x + 1``: a TypeError at capture naming the path, the type and the attribute;
    ``o.note = "plain"``: captured, replayed right, the note kept."""
    if kind == "model_output":
        pytest.importorskip("transformers")
    torch._dynamo.reset()
    x = torch.randn(8, 4, device=device)
    backend = _backend(name, mode, engine)
    model = _Attn()
    fn = backend.compile(model) if name == "piecewise" else model

    def forward(n: int) -> Any:
        out = _wrap(kind, fn(x[:n]) if name != "full" else x[:n] * 2)
        if extra == "tensor":
            out.extra = x[:n] + 1
        elif extra == "nested":
            out.extra = {"inner": [x[:n] + 1]}
        else:
            out.note = "plain"
        return out

    with torch.no_grad(), backend.capture_session():
        if extra != "plain":
            with pytest.raises(TypeError) as info:
                backend.capture_one(ShapeKey(8), lambda: forward(8), capture_inputs=x)
            text = str(info.value)
            assert "attribute 'extra'" in text and "output.extra" in text and "stale" in text, text
            assert type(_wrap(kind, x)).__qualname__ in text
            assert not backend.can_run(ShapeKey(8))
            torch._dynamo.reset()
            return
        for n in (8, 4):
            backend.capture_one(ShapeKey(n), lambda n=n: forward(n), capture_inputs=x)
    x.copy_(torch.randn_like(x))
    for n in (8, 4):
        got = backend.replay(ShapeKey(n))
        assert got.note == "plain"
        with torch.no_grad():
            torch.testing.assert_close(_leaf(kind, got), _leaf(kind, forward(n)))
    torch._dynamo.reset()


def quietly(case: Callable[..., None], *args: Any) -> None:
    """Run a case; a sharing fallback warning is allowed (a documented outcome), nothing else."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SharedOutputFallbackWarning)
        case(*args)


# -- item 4: the property --------------------------------------------------------------------

PROGRAM_READS = ["none", "item", "if", "tolist", "nonzero", "in_break"]


def _program(read: str, where: str, attribute: str, x: torch.Tensor) -> Callable[[int], Any]:
    """A breakable forward: one break, a host read ``where`` (before/after the break, or inside
    it), and an attribute set on a dataclass output."""

    def forward(n: int) -> Any:
        h = x[:n] * 2
        if read != "none" and read != "in_break" and where == "before":
            h = h * read_value(x, read)
        h = _scale_by_max(h) if read == "in_break" else h
        out = torch.empty_like(h)
        _softmax_into(h, out)
        if read != "none" and read != "in_break" and where == "after":
            out = out * read_value(x, read)
        o = Out(out + 1)
        if attribute == "tensor":
            o.extra = x[:n] - 1  # type: ignore[attr-defined]
        elif attribute == "plain":
            o.note = n  # type: ignore[attr-defined]
        return o

    return forward


def replay_property(
    backend_name: str, read: str, where: str, attribute: str, mode: str, mutations: list[float], device: str, engine: str
) -> None:
    """Every replay equals the eager forward on the changed inputs, or capture raised one of the
    documented errors (HostReadError: a host read in a segment; TypeError: a tensor the output
    walk cannot track). Never a value the graph did not compute."""
    g = torch.Generator().manual_seed(len(mutations))
    x = torch.randn(8, 4, generator=g).to(device)
    run = _program(read, where, attribute, x)
    backend = _backend(backend_name, mode, engine)
    sizes = (8, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SharedOutputFallbackWarning)
        with torch.no_grad(), backend.capture_session():
            try:
                for n in sizes:
                    backend.capture_one(ShapeKey(n), lambda n=n: run(n), capture_inputs=x)
            except HostReadError as exc:
                # Breakable: a read inside a segment (a break body is eager). Full on CUDA: any
                # read (a break is a plain call inside its one graph). Full's eager engine
                # re-runs the forward: never refused.
                segment_read = read not in ("none", "in_break")
                assert (backend_name == "breakable" and segment_read) or (
                    backend_name == "full" and engine == "cuda" and read != "none"
                ), exc
                assert not backend.can_run(exc.shape_key)
                return
            except TypeError as exc:
                assert attribute == "tensor" and "attribute 'extra'" in str(exc), exc
                return
    for scale in mutations:
        x.mul_(scale).add_(torch.randn(8, 4, generator=g).to(device))
        for n in sizes:
            got = backend.replay(ShapeKey(n))
            with torch.no_grad():
                ref = run(n)
            torch.testing.assert_close(got.y, ref.y)
            assert getattr(got, "note", None) == getattr(ref, "note", None)
            if attribute == "tensor":  # never reached: refused at capture
                torch.testing.assert_close(got.extra, ref.extra)


PROPERTY = st.fixed_dictionaries({
    "backend_name": st.sampled_from(["breakable", "full"]),
    "read": st.sampled_from(PROGRAM_READS),
    "where": st.sampled_from(["before", "after"]),
    "attribute": st.sampled_from(["none", "plain", "tensor"]),
    "mode": st.sampled_from(MODES),
    "mutations": st.lists(st.sampled_from([-1.0, 0.5, 2.0]), min_size=1, max_size=3),
})


# -- the CPU tests ---------------------------------------------------------------------------


@pytest.mark.parametrize("read", READS)
@pytest.mark.parametrize("name", ["breakable", "full"])
def test_a_host_read_inside_a_segment_is_refused(name: str, read: str) -> None:
    host_read_case(name, read, "before", "off", "cpu", "eager")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("read", ["item", "if", "tolist"])
def test_a_host_read_after_a_break_names_its_segment(read: str, mode: str) -> None:
    host_read_case("breakable", read, "after", mode, "cpu", "eager")


@pytest.mark.parametrize("where", ["before", "after"])
@pytest.mark.parametrize("read", ["item", "nonzero"])
def test_piecewise_refuses_a_host_read_around_its_compiled_callable(read: str, where: str) -> None:
    host_read_case("piecewise", read, where, "on", "cpu", "eager")


@pytest.mark.parametrize("mode", MODES)
def test_a_host_read_in_a_break_body_or_a_warmup_is_fine(mode: str) -> None:
    break_read_case(mode, "cpu", "eager")


def test_integer_indexing_and_sized_ops_are_not_host_reads() -> None:
    """Ops torch tags as dynamic-shape that read nothing on the host for these arguments."""
    x = torch.randn(8, 4)
    idx = torch.tensor([0, 2, 5])
    reps = torch.tensor([1, 2, 1])
    labels = torch.tensor([0, 3, 1])

    def forward() -> torch.Tensor:
        a = x[idx].sum(0)
        b = torch.repeat_interleave(x[:3], reps, dim=0, output_size=4).sum(0)
        c = torch.nn.functional.one_hot(labels, num_classes=4).float() @ x[:4]
        return a + b + c.sum(0)

    backend = _backend("breakable", "off", "eager")
    with torch.no_grad(), backend.capture_session():
        backend.capture_one(ShapeKey(8), forward, capture_inputs=x)
    x.copy_(torch.randn_like(x))
    torch.testing.assert_close(backend.replay(ShapeKey(8)), forward())


@pytest.mark.parametrize("mode", ["off", "on"])
@pytest.mark.parametrize("mask_kind", ["2d", "none"])
def test_llama_stock_sdpa_mask_check_is_refused_with_advice(mask_kind: str, mode: str) -> None:
    llama_sdpa_mask_case(mask_kind, mode, "cpu", "eager")


@pytest.mark.parametrize("mode", ["off", "on"])
@pytest.mark.parametrize("attention", ["sdpa", "sglang_bcg_break"])
def test_llama_with_a_4d_mask_replays_the_masks_new_values(attention: str, mode: str) -> None:
    llama_4d_mask_case(attention, mode, "cpu", "eager")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("extra", ["tensor", "nested", "plain"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["full", "breakable"])
def test_a_tensor_on_an_extra_output_attribute_is_refused(name: str, kind: str, extra: str, mode: str) -> None:
    quietly(extra_attribute_case, name, kind, extra, mode, "cpu", "eager")


@pytest.mark.parametrize("extra", ["tensor", "plain"])
@pytest.mark.parametrize("kind", ["dataclass", "holder"])
def test_piecewise_refuses_a_tensor_on_an_extra_output_attribute(kind: str, extra: str) -> None:
    quietly(extra_attribute_case, "piecewise", kind, extra, "on", "cpu", "eager")


def test_an_attribute_aliasing_a_key_of_a_model_output_is_allowed() -> None:
    """transformers' ModelOutput keeps its fields as attributes too: the very values of its keys."""
    pytest.importorskip("transformers")
    from transformers.modeling_outputs import BaseModelOutputWithPast

    from sglang_bcg_plugin.output.trees import flatten

    t = torch.randn(2)
    out = BaseModelOutputWithPast(last_hidden_state=t)
    out.hidden_states = (t * 2,)  # set as an attribute: transformers makes it a key too
    _, leaves = flatten(out)
    assert [p for p, _ in leaves] == ["output['last_hidden_state']", "output['hidden_states'][0]"]


def test_list_and_tuple_subclasses_with_tensor_attributes_are_refused() -> None:
    from sglang_bcg_plugin.output.trees import flatten

    class Tagged(list):  # type: ignore[type-arg]
        pass

    ok = Tagged([torch.zeros(1)])
    ok.note = "plain"  # type: ignore[attr-defined]
    assert len(flatten(ok)[1]) == 1
    bad = Tagged([torch.zeros(1)])
    bad.extra = torch.ones(1)  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match=r"attribute 'extra' is not one of its items"):
        flatten(bad)


def test_a_plain_value_holding_a_dict_subclass_with_a_tensor_attribute_is_refused() -> None:
    from sglang_bcg_plugin.output.trees import flatten

    class Holder:
        def __init__(self, d: dict[str, int]) -> None:
            self.d = d

    d = OutDict(a=1)
    d.t = torch.ones(1)  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match=r"at output\.d\.t"):
        flatten(Holder(d))


def test_host_read_error_from_a_cuda_capture_failure() -> None:
    """What a stream capture raises for a host sync becomes the same HostReadError (key,
    segment, the user's line); any other error is left alone."""
    from sglang_bcg_plugin.engines.recorder import host_read_error

    def sync() -> None:
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore")

    try:
        sync()
    except RuntimeError as exc:
        err = host_read_error(exc, ShapeKey(4), 2)
    assert err is not None and err.segment == 2 and err.shape_key == ShapeKey(4)
    assert "operation not permitted when stream is capturing" in err.op and "more" not in err.op
    assert "test_host_reads.py" in str(err) and "segment 2" in str(err)
    assert host_read_error(RuntimeError("something else"), ShapeKey(4), 0) is None
    assert host_read_error(ValueError("operation not permitted when stream is capturing"), ShapeKey(4), 0) is None
    same = HostReadError(ShapeKey(4), None, "op")
    assert host_read_error(same, ShapeKey(4), 0) is same and "inside its graph" in str(same)
    assert "at " not in str(HostReadError(ShapeKey(4), 0, "op")).split("(op")[1][:3]
    from sglang_bcg_plugin.errors import user_frame

    assert user_frame([(torch.__file__, 1, "f")]) is None  # nothing outside torch: no line named


def test_a_segment_capture_failing_on_a_host_sync_raises_host_read_error() -> None:
    """The segment recorder turns a stream capture's host-sync error into HostReadError with the
    open segment's index, the original error as its cause, and rolls the key back."""
    x = torch.randn(8, 4)

    def forward() -> torch.Tensor:
        out = torch.empty_like(x)
        _softmax_into(x * 2, out)
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    backend = _backend("breakable", "on", "eager", num_warmups=0)
    with torch.no_grad(), backend.capture_session():
        with pytest.raises(HostReadError, match=r"segment 1 \(a host sync the stream capture refused") as info:
            backend.capture_one(ShapeKey(8), forward, capture_inputs=x)
        assert isinstance(info.value.__cause__, RuntimeError) and info.value.segment == 1
        assert not backend.can_run(ShapeKey(8))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(PROPERTY)
def test_replay_never_hands_out_values_the_graph_did_not_compute(case: dict[str, Any]) -> None:
    replay_property(**case, device="cpu", engine="eager")
