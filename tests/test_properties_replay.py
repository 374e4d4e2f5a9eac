"""Property test (hypothesis): replay == eager after the inputs change, in every output mode.

Random forwards over random output trees whose leaves are fresh tensors, views with offsets and
strides (``t[1:]``, ``t.t()``, ``t[:, ::2]``), the input itself or a view of it (with or without
``capture_inputs``: the backend must tell memory it does not own from the forward's own), a
tensor the "model" keeps across calls, and aliases of an earlier leaf; keys captured in random
order, in random stream partitions; sharing ``off``, ``on`` and ``released``; Full and Breakable
(the latter with a ``@graph_break`` in the forward). Every key replays exactly what an eager
forward on the new inputs returns — or falls back with a ``SharedOutputFallbackWarning`` (a
documented outcome: still right) — never a wrong value.

``check_case`` takes the device and engine: ``tests/gpu/test_properties_gpu.py`` runs the same
property on real CUDA graphs.
"""

from __future__ import annotations

from sglang_bcg_plugin.output.mode import mode_of_option

import warnings
from typing import Any

import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sglang_bcg_plugin import BackendOptions, ShapeKey, SharedOutputFallbackWarning, create_backend, graph_break
from sglang_bcg_plugin.output.trees import flatten

H = 4
LEAVES = ["fresh", "offset", "transpose", "strided", "input", "input_slice", "input_tail", "kept", "alias", "none", "value"]

leaf = st.sampled_from(LEAVES)
tree = st.recursive(
    leaf,
    lambda kids: st.one_of(
        st.lists(kids, min_size=1, max_size=3).map(lambda c: ("tuple", c)),
        st.lists(kids, min_size=1, max_size=3).map(lambda c: ("list", c)),
        st.dictionaries(st.sampled_from(["a", "b", "c"]), kids, min_size=1, max_size=3).map(lambda d: ("dict", sorted(d.items()))),
    ),
    max_leaves=5,
)

case_strategy = st.fixed_dictionaries(
    {
        "desc": tree,
        "sizes": st.lists(st.integers(2, 12), min_size=1, max_size=4, unique=True),
        "streams": st.lists(st.sampled_from([None, 1]), min_size=4, max_size=4),
        "order": st.permutations(range(4)),
        "backend": st.sampled_from(["full", "breakable"]),
        "mode": st.sampled_from([False, True, "released"]),
        "source": st.sampled_from(["auto", "adopt", "reserve"]),
        "declare_inputs": st.booleans(),
        "seed": st.integers(0, 2**16),
    }
)


@graph_break(reads=("h",))
def _brk(h: torch.Tensor) -> torch.Tensor:
    return torch.tanh(h)


class Forward:
    """One key's forward: builds the output tree from the static input ``x[:n]``."""

    def __init__(self, desc: Any, x: torch.Tensor, n: int, w: torch.Tensor, kept: torch.Tensor, brk: bool) -> None:
        self.desc, self.x, self.n, self.w, self.kept, self.brk = desc, x, n, w, kept, brk

    def __call__(self) -> Any:
        h = self.x[: self.n] @ self.w  # (n, 2H)
        self._h = _brk(h) if self.brk else torch.tanh(h)
        self._prev: torch.Tensor | None = None
        return self._build(self.desc)

    def _leaf(self, kind: str) -> Any:
        h, x = self._h, self.x
        made = {
            "fresh": lambda: h * 2,
            "offset": lambda: (h + 1)[1:],
            "transpose": lambda: (h - 1).t(),
            "strided": lambda: (h * 3)[:, ::2],
            "input": lambda: x[: self.n],
            "input_slice": lambda: x[1 : self.n],
            "input_tail": lambda: x[-self.n :],
            "kept": lambda: self.kept[-self.n :],
            "alias": lambda: self._prev,
        }
        if kind in made:
            t = made[kind]()
            if t is not None:
                self._prev = t
            return t
        return None if kind == "none" else 7

    def _build(self, d: Any) -> Any:
        if isinstance(d, str):
            return self._leaf(d)
        kind, kids = d
        if kind == "dict":
            return {k: self._build(v) for k, v in kids}
        built = [self._build(k) for k in kids]
        return tuple(built) if kind == "tuple" else built


def _same(got: Any, want: Any, where: str) -> None:
    sg, lg = flatten(got)
    sw, lw = flatten(want)
    assert [p for p, _ in lg] == [p for p, _ in lw], where
    for (path, a), (_, b) in zip(lg, lw, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, (where, path)
        assert torch.equal(a, b), (where, path, (a - b).abs().max())


def check_case(case: dict[str, Any], device: str, engine: str) -> None:
    g = torch.Generator().manual_seed(case["seed"])
    sizes = case["sizes"]
    big = max(sizes)
    x = torch.randn(big, H, generator=g).to(device)
    w = torch.randn(H, 2 * H, generator=g).to(device)
    kept = torch.randn(big, H, generator=g).to(device)
    before_kept = kept.clone()
    keys = [ShapeKey(n, case["streams"][i]) for i, n in enumerate(sizes)]
    order = [keys[i] for i in case["order"] if i < len(keys)]
    brk = case["backend"] == "breakable"
    fwd = {k: Forward(case["desc"], x, k.size, w, kept, brk) for k in keys}
    backend = create_backend(
        case["backend"],
        options=BackendOptions(output_mode=mode_of_option(case["mode"]), engine=engine, shared_buffer=case["source"]),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SharedOutputFallbackWarning)
        with torch.no_grad(), backend.capture_session():
            for k in order:
                backend.capture_one(k, fwd[k], capture_inputs=x if case["declare_inputs"] else None)
    torch.testing.assert_close(kept, before_kept)  # memory the backend does not own: never written
    for _ in range(2):
        x.copy_(torch.randn(x.shape, generator=g).to(device))
        for k in order:
            got = backend.replay(k)  # valid until the next replay of its partition
            with torch.no_grad():
                _same(got, fwd[k](), f"{case['backend']} mode={case['mode']} {k}")
    backend.cleanup()


def _issue_case(desc: Any, backend: str) -> dict[str, Any]:
    """The reported shape: largest first, sharing on, the default buffer source, no inputs declared."""
    return {
        "desc": desc, "sizes": [8, 4, 2], "streams": [None] * 4, "order": [0, 1, 2, 3], "backend": backend,
        "mode": True, "source": "auto", "declare_inputs": False, "seed": 0,
    }


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=case_strategy)
@example(case=_issue_case("kept", "full"))
@example(case=_issue_case(("tuple", ["input_tail", "fresh"]), "breakable"))
def test_replay_equals_eager_in_every_mode(case: dict[str, Any]) -> None:
    check_case(case, "cpu", "eager")
