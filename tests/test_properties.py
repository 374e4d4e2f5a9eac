"""Property-based tests (hypothesis) of the sharing policy, ``ShapeKey`` and the env-var parser.

Sharing: random output trees (tuple / list / dict / dataclass / named tuple / ``None`` / plain
values, nested), leaf dtypes, trailing dims, row counts (a multiple of the key size, or fixed),
leaves aliasing the static input or another leaf, per-key structural mutations, random capture
order and ``stream_idx``. For every key: sharing on == sharing off == eager, bit for bit, or
the key fell back with a reason; never a wrong value. Strict mode: a key is either refused with
``OutputStructureError`` (and absent) or right.

Fuzzing: ``ShapeKey`` and ``check_key`` with hostile values raise only ``TypeError`` /
``ValueError``; the env-var parser returns ``True``/``False``/``None`` or raises ``ValueError``
naming the variable; a bad env value refuses the capture session and leaves the backend usable.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from typing import Any, NamedTuple
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from _support import make_backend
from sglang_bcg_plugin import (
    ENV_SHARE_OUTPUT,
    OutputStructureError,
    ShapeKey,
    SharedOutputFallbackWarning,
)
from sglang_bcg_plugin._words import parse_bool_env
from sglang_bcg_plugin.output.mode import parse_mode
from sglang_bcg_plugin.backends.base import check_key
from sglang_bcg_plugin.output.trees import flatten


def _shares(*args: object, **kwargs: object) -> bool:
    """Sharing on (``on`` or ``released``)."""
    from sglang_bcg_plugin.output.mode import resolve_output_mode

    return resolve_output_mode(*args, **kwargs) != "off"  # type: ignore[arg-type]

H = 4
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclasses.dataclass
class DC:
    a: Any
    b: Any


class NT(NamedTuple):
    first: Any
    second: Any


DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8, torch.bool]

# -- output-tree descriptions ---------------------------------------------------------------
# A leaf description is a tuple:
#   ("t", dtype_idx, trailing, rows)  rows = ("mul", m) -> m * size rows, ("const", c) -> c rows
#   ("input",)        the static input itself (aliases a protected storage)
#   ("input_view",)   a non-contiguous view of the static input
#   ("alias",)        the previous tensor leaf again (two paths, one storage)
#   ("scalar",)       a 0-dim tensor (never shareable)
#   ("none",) / ("value", v)

tensor_leaf = st.tuples(
    st.just("t"),
    st.integers(0, len(DTYPES) - 1),
    st.lists(st.integers(0, 3), min_size=0, max_size=2).map(tuple),
    st.one_of(st.tuples(st.just("mul"), st.integers(0, 3)), st.tuples(st.just("const"), st.integers(0, 3))),
)
other_leaf = st.sampled_from([("input",), ("input_view",), ("alias",), ("scalar",), ("none",), ("value", 7), ("value", "x")])
leaf = st.one_of(tensor_leaf, tensor_leaf, other_leaf)


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(children, min_size=0, max_size=3).map(lambda c: ("tuple", c)),
        st.lists(children, min_size=0, max_size=3).map(lambda c: ("list", c)),
        st.dictionaries(st.sampled_from(["h", "logits", "aux", "k"]), children, max_size=3).map(
            lambda d: ("dict", list(d.items()))
        ),
        st.tuples(children, children).map(lambda c: ("dc", list(c))),
        st.tuples(children, children).map(lambda c: ("nt", list(c))),
    )


tree = st.recursive(leaf, _containers, max_leaves=6)

MUTATIONS = ["dtype", "trailing", "rows_up", "none", "scalar", "value", "drop", "retype"]


class Builder:
    """Builds the output of one key from a tree description; deterministic in the input."""

    def __init__(self, desc: Any, mutation: tuple[str, int] | None) -> None:
        self.desc = desc
        self.mutation = mutation

    def __call__(self, x: torch.Tensor, weights: dict[int, torch.Tensor]) -> Any:
        self._n = 0
        self._prev: torch.Tensor | None = None
        self._x = x
        self._w = weights
        return self._build(self.desc)

    def _mut(self) -> str | None:
        """The mutation for the current leaf (leaves numbered in build order)."""
        i = self._n
        self._n += 1
        if self.mutation is not None and self.mutation[1] == i:
            return self.mutation[0]
        return None

    def _tensor(self, d: tuple[Any, ...], mut: str | None) -> Any:
        _, dt, trailing, rows_spec = d
        dtype = DTYPES[dt]
        size = self._x.shape[0]
        rows = rows_spec[1] * size if rows_spec[0] == "mul" else rows_spec[1]
        if mut == "trailing":
            trailing = (*trailing, 2)
        if mut == "rows_up":
            rows += 1
        if mut == "dtype":
            dtype = torch.float64 if dtype != torch.float64 else torch.float32
        cols = math.prod(trailing)
        w = self._w.setdefault(cols, torch.randn(H, cols, generator=torch.Generator().manual_seed(cols)))
        base = self._x @ w  # (size, cols), deterministic in x
        if rows <= size:
            t = base[:rows]
        else:
            reps = -(-rows // size) if size else 0
            t = base.repeat(reps, 1)[:rows] + torch.arange(rows, dtype=base.dtype).unsqueeze(1)
        t = t.reshape(rows, *trailing)
        if dtype == torch.bool:
            t = t > 0
        elif not dtype.is_floating_point:
            t = (t * 10).clamp(0 if dtype == torch.uint8 else -1000, 255 if dtype == torch.uint8 else 1000).to(dtype)
        else:
            t = t.to(dtype)
        self._prev = t
        return t

    def _build(self, d: Any) -> Any:
        kind = d[0]
        if kind in ("tuple", "list", "dict", "dc", "nt"):
            kids = [self._build(c) for c in (d[1] if kind != "dict" else [v for _, v in d[1]])]
            if kind == "tuple":
                return tuple(kids)
            if kind == "list":
                return kids
            if kind == "dict":
                return dict(zip([k for k, _ in d[1]], kids, strict=True))
            if kind == "dc":
                return DC(*kids)
            return NT(*kids)
        mut = self._mut()
        if mut == "none":
            return None
        if mut == "scalar":
            return self._x.sum()
        if mut == "value":
            return "mutated"
        if mut == "drop":
            return ()
        if mut == "retype":
            return [self._x[:1].clone()]
        if kind == "t":
            return self._tensor(d, mut)
        if kind == "input":
            self._prev = self._x
            return self._x
        if kind == "input_view":
            v = self._x[:, ::2]
            self._prev = v
            return v
        if kind == "alias":
            return self._prev if self._prev is not None else None
        if kind == "scalar":
            return self._x.sum() * 2
        if kind == "none":
            return None
        return d[1]


def _assert_tree_equal(a: Any, b: Any, where: str) -> None:
    sa, la = flatten(a)
    sb, lb = flatten(b)
    assert type(a) is type(b), where
    assert [p for p, _ in la] == [p for p, _ in lb], where
    for (path, ta), (_, tb) in zip(la, lb, strict=True):
        assert ta.dtype == tb.dtype and ta.shape == tb.shape, (where, path)
        assert torch.equal(ta, tb), (where, path)
    # non-tensor leaves and containers: rebuilding with the same tensors gives equal structure
    from sglang_bcg_plugin.output.trees import diff

    assert diff(sa, sb) is None, (where, diff(sa, sb))


sharing_case = st.fixed_dictionaries(
    {
        "desc": tree,
        "sizes": st.lists(st.integers(1, 24), min_size=1, max_size=5, unique=True),
        "streams": st.lists(st.sampled_from([None, 0, 1]), min_size=5, max_size=5),
        "order": st.sampled_from(["largest_first", "ascending", "shuffled"]),
        "perm_seed": st.integers(0, 2**16),
        "mutations": st.lists(
            st.one_of(st.none(), st.none(), st.tuples(st.sampled_from(MUTATIONS), st.integers(0, 5))),
            min_size=5,
            max_size=5,
        ),
        "backend": st.sampled_from(["breakable", "full"]),
    }
)


def _keys_in_order(case: dict[str, Any]) -> list[ShapeKey]:
    keys = [ShapeKey(s, case["streams"][i]) for i, s in enumerate(case["sizes"])]
    if case["order"] == "largest_first":
        return sorted(keys, key=lambda k: -k.size)
    if case["order"] == "ascending":
        return sorted(keys, key=lambda k: k.size)
    g = torch.Generator().manual_seed(case["perm_seed"])
    return [keys[i] for i in torch.randperm(len(keys), generator=g).tolist()]


def _capture(backend: Any, keys: list[ShapeKey], fns: dict[ShapeKey, Any], inputs: dict[ShapeKey, torch.Tensor]) -> list[ShapeKey]:
    """Capture in order; returns the keys refused by strict mode."""
    refused = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SharedOutputFallbackWarning)
        with backend.capture_session():
            for key in keys:
                try:
                    backend.capture_one(key, fns[key], capture_inputs=inputs[key])
                except OutputStructureError as err:
                    assert err.shape_key == key and err.reason and err.path.startswith("output")
                    assert not backend.can_run(key)
                    refused.append(key)
    return refused


@FAST
@given(case=sharing_case, strict=st.booleans())
def test_sharing_on_equals_off_equals_eager_or_falls_back(case: dict[str, Any], strict: bool) -> None:
    keys = _keys_in_order(case)
    weights: dict[int, torch.Tensor] = {}
    builders = {ShapeKey(s, case["streams"][i]): Builder(case["desc"], case["mutations"][i]) for i, s in enumerate(case["sizes"])}
    gen = torch.Generator().manual_seed(case["perm_seed"])
    inputs_on = {k: torch.randn(k.size, H, generator=gen) for k in keys}
    inputs_off = {k: v.clone() for k, v in inputs_on.items()}

    def fns_for(inputs: dict[ShapeKey, torch.Tensor]) -> dict[ShapeKey, Any]:
        return {k: (lambda k=k: builders[k](inputs[k], weights)) for k in keys}

    fns_on, fns_off = fns_for(inputs_on), fns_for(inputs_off)
    on = make_backend(case["backend"], True, strict_outputs=strict)
    off = make_backend(case["backend"], False)
    refused = _capture(on, keys, fns_on, inputs_on)
    assert _capture(off, keys, fns_off, inputs_off) == []
    if not strict:
        assert refused == []

    # new inputs, identical for both backends
    for k in keys:
        inputs_on[k].copy_(torch.randn(k.size, H, generator=gen))
        inputs_off[k].copy_(inputs_on[k])
    replay_order = list(reversed(keys)) + keys
    for k in replay_order:
        expected = fns_off[k]()
        got_off = off.replay(k)
        _assert_tree_equal(got_off, expected, f"share off {k}")
        if k in refused:
            continue
        got_on = on.replay(k)
        _assert_tree_equal(got_on, expected, f"share on {k}")

    # partitions never alias: a replay of one stream leaves another stream's last output intact
    by_stream: dict[Any, list[ShapeKey]] = {}
    for k in keys:
        if k not in refused:
            by_stream.setdefault(k.stream_idx, []).append(k)
    if len(by_stream) > 1:
        firsts = [ks[0] for ks in by_stream.values()]
        outs = {k: on.replay(k) for k in firsts}
        for k in firsts:
            _assert_tree_equal(outs[k], fns_on[k](), f"cross-stream {k}")

    report = on.memory_report()
    captured = [k for k in keys if k not in refused]
    assert [r.key for r in report.keys] == captured
    for r in report.keys:
        assert r.shared or (r.fallback and r.key in report.fallbacks), r
        assert r.shared != (r.fallback is not None)
    assert 0 <= report.resident_output_bytes
    assert report.saved_bytes <= report.logical_output_bytes
    off_report = off.memory_report()
    assert not off_report.fallbacks and not any(r.shared for r in off_report.keys)
    assert off_report.logical_output_bytes == sum(r.logical_output_bytes for r in report.keys) + sum(
        r.logical_output_bytes for r in off_report.keys if r.key in refused
    )

    # well-formed case: no mutations, largest first, >= 1 row per leaf, no 0-dim leaves
    # -> nothing falls back and each partition holds exactly its largest key's output
    if case["order"] == "largest_first" and not any(case["mutations"]) and not strict:
        _, leaves0 = flatten(fns_on[keys[0]]())
        if leaves0 and all(t.dim() > 0 for _, t in leaves0):
            assert not report.fallbacks, dict(report.fallbacks)


@FAST
@given(case=sharing_case)
def test_well_formed_trees_never_fall_back(case: dict[str, Any]) -> None:
    """No mutations, largest first, no 0-dim leaves: sharing always applies, and each partition
    keeps exactly its largest key's output bytes resident (minus aliases it had to copy)."""
    desc = case["desc"]
    keys = sorted((ShapeKey(s, case["streams"][i]) for i, s in enumerate(case["sizes"])), key=lambda k: -k.size)
    builder = Builder(desc, None)
    weights: dict[int, torch.Tensor] = {}
    inputs = {k: torch.randn(k.size, H) for k in keys}
    fns = {k: (lambda k=k: builder(inputs[k], weights)) for k in keys}
    _, leaves = flatten(fns[keys[0]]())
    assume(all(t.dim() > 0 for _, t in leaves))
    backend = make_backend(case["backend"], True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SharedOutputFallbackWarning)
        with backend.capture_session():
            for k in keys:
                backend.capture_one(k, fns[k], capture_inputs=inputs[k])
    report = backend.memory_report()
    assert not report.fallbacks and all(r.shared for r in report.keys)
    owners = {}
    for k in keys:
        owners.setdefault(k.stream_idx, k)
    owner_bytes = sum(r.resident_output_bytes for r in report.keys if owners[r.key.stream_idx] == r.key)
    assert report.resident_output_bytes == owner_bytes
    for k in keys:
        inputs[k].copy_(torch.randn_like(inputs[k]))
    for k in keys:
        _assert_tree_equal(backend.replay(k), fns[k](), f"{k}")


# -- ShapeKey and check_key fuzzing ---------------------------------------------------------

hostile = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.binary(max_size=4),
    st.lists(st.integers(), max_size=2),
    st.tuples(st.integers()),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=1),
    st.just(object()),
    st.just(torch.tensor(3)),
    st.just(float("nan")),
    st.sampled_from(["", " ", "0", "1", "-1", "\x00", "é", "8"]),
)


@settings(max_examples=300, deadline=None)
@given(size=hostile, stream_idx=hostile, label=hostile)
def test_shape_key_hostile_values_only_documented_errors(size: Any, stream_idx: Any, label: Any) -> None:
    try:
        key = ShapeKey(size, stream_idx, label)
    except (TypeError, ValueError) as err:
        assert "ShapeKey." in str(err)
        return
    assert type(size) is int and size >= 1
    assert stream_idx is None or (type(stream_idx) is int and stream_idx >= 0)
    assert label is None or (isinstance(label, str) and label)
    assert key == ShapeKey(size, stream_idx, label) and hash(key) == hash(ShapeKey(size, stream_idx, label))
    assert check_key(key) is key


class _Key:
    def __init__(self, size: Any, stream_idx: Any, hashable: bool) -> None:
        self.size = size
        self.stream_idx = stream_idx
        if not hashable:
            self.__hash__ = None  # type: ignore[assignment]

    __hash__ = object.__hash__


class _Unhashable:
    __hash__ = None  # type: ignore[assignment]

    def __init__(self, size: Any) -> None:
        self.size = size
        self.stream_idx = None


@settings(max_examples=200, deadline=None)
@given(size=hostile, stream_idx=hostile, kind=st.sampled_from(["obj", "unhashable", "missing", "raw"]))
def test_check_key_hostile_objects_only_documented_errors(size: Any, stream_idx: Any, kind: str) -> None:
    obj: Any = {
        "obj": lambda: _Key(size, stream_idx, True),
        "unhashable": lambda: _Unhashable(size),
        "missing": lambda: type("NoStream", (), {"size": size})(),
        "raw": lambda: size,
    }[kind]()
    try:
        key = check_key(obj)
    except (TypeError, ValueError) as err:
        assert "shape key" in str(err)
        return
    assert key is obj
    assert type(obj.size) is int and obj.size >= 1
    hash(key)


def test_backend_rejects_hostile_keys_and_stays_usable(backend_name: str) -> None:
    backend = make_backend(backend_name, True)
    with backend.capture_session():
        for bad in (_Unhashable(4), _Key(0, None, True), _Key(True, None, True), _Key(4.0, None, True), 4, "4"):
            with pytest.raises((TypeError, ValueError)):
                backend.capture_one(bad, lambda: torch.ones(4))
        backend.capture_one(ShapeKey(4), lambda: torch.ones(4))
    assert backend.captured_keys() == [ShapeKey(4)]


# -- env-var parser fuzzing -----------------------------------------------------------------

env_text = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["1", "0", "true", "FALSE", " yes ", "No", "ON", "off\n", "", "   ", "\t", "2", "truee",
                     "ｔｒｕｅ", "İ", "\u2003", "y", "enable", "None", "nan"]),
    st.builds(lambda w, pad: pad + w + pad, st.sampled_from(["1", "0", "true", "false", "yes", "no", "on", "off"]).map(
        lambda s: "".join(c.upper() if i % 2 else c for i, c in enumerate(s))), st.sampled_from(["", " ", "\t\n"])),
)

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@settings(max_examples=300, deadline=None)
@given(raw=env_text)
@example(raw=" RELEASED ")  # found by hypothesis: the third mode is no boolean but shares
def test_env_parser_hostile_values(raw: str) -> None:
    env = {ENV_SHARE_OUTPUT: raw}
    try:
        value = parse_bool_env(ENV_SHARE_OUTPUT, env)
    except ValueError as err:
        assert ENV_SHARE_OUTPUT in str(err) and "1/0, true/false, yes/no, on/off" in str(err)
        assert raw.strip() and raw.strip().lower() not in _TRUE | _FALSE
        if raw.strip().lower() == "released":  # not a boolean, but the third output mode: it shares
            assert _shares(None, environ=env) is True
            return
        with pytest.raises(ValueError, match=ENV_SHARE_OUTPUT):
            _shares(None, environ=env)
        # an explicit setting never consults the broken variable
        assert _shares("on", environ=env) is True
        return
    if not raw.strip():
        assert value is None and _shares(None, environ=env) is False
    else:
        assert value is (raw.strip().lower() in _TRUE)
        assert _shares(None, environ=env) is value


os_env_text = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=10
) | st.sampled_from(["on", "OFF", " 1 ", "bogus"])


@settings(max_examples=60, deadline=None)
@given(raw=os_env_text, backend=st.sampled_from(["breakable", "full"]))
def test_bad_env_refuses_session_and_leaves_backend_usable(raw: str, backend: str) -> None:
    """Through the real ``os.environ``: a session either opens with the parsed setting, or the
    open raises ``ValueError`` and no half-open session remains."""
    b = make_backend(backend, None)  # type: ignore[arg-type]
    with mock.patch.dict(os.environ, {ENV_SHARE_OUTPUT: raw}):
        try:
            expected = parse_mode(raw, ENV_SHARE_OUTPUT, text=True)  # a boolean word or "released", any case
        except ValueError:
            with pytest.raises(ValueError, match=ENV_SHARE_OUTPUT), b.capture_session():
                pass  # pragma: no cover
            assert b.output_mode_active is None
            expected = None
        else:
            with b.capture_session():
                assert b.output_mode_active == (expected or "off")
                b.capture_one(ShapeKey(4), lambda: torch.ones(4, 2))
            b.cleanup()
    with mock.patch.dict(os.environ, {ENV_SHARE_OUTPUT: "1"}), b.capture_session():
        assert b.output_mode_active == "on"
        b.capture_one(ShapeKey(2), lambda: torch.ones(2, 2))
    assert b.captured_keys() == [ShapeKey(2)]
