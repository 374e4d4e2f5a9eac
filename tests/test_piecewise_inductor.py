"""Piecewise with Inductor-compiled pieces on the eager engine (Inductor's CPU backend).

Kept to few compilations (CI time): one module-scoped capture of a three-piece model, and one
tiny llama bench run (piecewise, full and the Graph Trees reference, each compiled once). The
rest are unit checks of the helpers.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

from sglang_bcg_plugin import BackendOptions, ShapeKey, create_backend
from sglang_bcg_plugin.backends.piecewise import PiecewiseBackend
from sglang_bcg_plugin.backends.piecewise.compile import _canonical
from sglang_bcg_plugin.backends.piecewise.inductor import CompiledPiece, InductorPieces, dense_fresh
from sglang_bcg_plugin.bench.output import plot_groups
from sglang_bcg_plugin.bench.runner import BenchRow, variants_for
from sglang_bcg_plugin.cli import main
from sglang_bcg_plugin.output.trees import flatten

from splitting_ops import (  # tests/splitting_ops.py
    EXPIRED,
    MADE,
    SEEN_CONTIGUOUS,
    fresh_triple,
    heads_mix,
    mix,
    probe_expired,
    write_softmax,
)

H = 8
SIZES = [16, 8, 5, 2, 1]  # largest first, 1 included


class Mixed(torch.nn.Module):
    """Three pieces around two splitting calls, with what Inductor must get right at a boundary:
    strided views crossing a splitting call (``k``, ``v`` of a split ``qkv``), a buffer the
    splitting op writes, and outputs that alias the input or are views."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.register_buffer("w0", torch.randn(H, 3 * H, generator=g) / H**0.5)
        self.register_buffer("w1", torch.randn(H, H, generator=g) / H**0.5)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> dict[str, torch.Tensor]:
        qkv = x @ self.w0 + pos[:, None]
        q, k, v = qkv.split([H, H, H], dim=-1)
        a = mix(q)  # reads a strided view; k and v (strided, fresh) cross this call
        h = a * k + v
        out = torch.empty_like(h)
        write_softmax(h, out)
        y = out * 2.0 + h
        return {"y": torch.relu(y @ self.w1), "t": (h * 0.5).t(), "x": x[:, :2]}


class Captured:
    """The module-scoped capture: the counts are read after the first key and after all."""

    def __init__(self) -> None:
        torch._dynamo.reset()
        self.backend = create_backend(
            "piecewise",
            options=BackendOptions(engine="eager", output_mode="on"),
            splitting_ops=[mix, write_softmax],
            inductor=True,
        )
        assert isinstance(self.backend, PiecewiseBackend)
        self.model = Mixed()
        self.fn = self.backend.compile(self.model)
        self.x, self.pos = torch.randn(max(SIZES), H), torch.randn(max(SIZES))
        graphs = counters["stats"]["unique_graphs"]
        self.piece_compilations: list[int] = []
        with torch.no_grad(), self.backend.capture_session():
            for s in SIZES:
                x, pos = self.x[:s], self.pos[:s]
                self.backend.capture_one(ShapeKey(s), lambda x=x, pos=pos: self.fn(x, pos), capture_inputs=(self.x, self.pos))
                self.piece_compilations.append(self.backend.num_piece_compilations)
        self.dynamo_graphs = counters["stats"]["unique_graphs"] - graphs

    def refill(self) -> None:
        self.x.copy_(torch.randn_like(self.x))
        self.pos.copy_(torch.randn_like(self.pos))


@pytest.fixture(scope="module")
def captured() -> Iterator[Captured]:
    c = Captured()
    yield c
    c.backend.cleanup()
    torch._dynamo.reset()


def _leaves(out: Any) -> dict[str, torch.Tensor]:
    return {str(path): t for path, t in flatten(out)[1]}


def test_one_inductor_compilation_per_piece_serves_every_size(captured: Captured) -> None:
    backend = captured.backend
    (summary,) = backend.split_summaries
    assert summary.num_pieces == 3 and summary.num_splitting_calls == 2
    # all three pieces compiled in the first key's warmups; no size added one
    assert captured.piece_compilations == [3] * len(SIZES)
    assert backend.num_compilations == captured.dynamo_graphs == 1
    assert backend.inductor and backend.num_piece_compilations == 3
    # Inductor's kernels are chosen by a real size hint: "auto" traces backed, size-oblivious
    assert captured.fn.dynamic == "size_oblivious"
    assert 0 < backend.inductor_seconds <= backend.compile_seconds
    assert {backend.num_segments(ShapeKey(s)) for s in SIZES} == {3}


def test_replay_equals_the_compiled_callable_and_the_model(captured: Captured) -> None:
    backend = captured.backend
    report = backend.memory_report()
    assert not report.fallbacks and all(k.shared for k in report.keys)
    for _ in range(2):
        captured.refill()
        for s in [1, 16, 5, 8, 2]:
            got = _leaves(backend.replay(ShapeKey(s)))
            got = {p: t.clone() for p, t in got.items()}
            x, pos = captured.x[:s].clone(), captured.pos[:s].clone()
            with torch.no_grad():
                compiled = _leaves(captured.fn(x, pos))  # Inductor's numerics, no capture
                eager = _leaves(captured.model(x, pos))  # the uncompiled model
            assert list(got) == list(compiled) == list(eager)
            for path, t in got.items():
                assert t.shape == eager[path].shape, path
                torch.testing.assert_close(t, compiled[path], rtol=0, atol=0, msg=path)
                torch.testing.assert_close(t, eager[path], rtol=1e-5, atol=1e-5, msg=path)
    # the output aliasing the input is a copy: replay never hands out the caller's input
    out = backend.replay(ShapeKey(16))
    assert out["x"].untyped_storage().data_ptr() != captured.x.untyped_storage().data_ptr()


def test_bench_llama_inductor_variants_and_graph_trees_row(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    rc = main(["bench", "--model", "llama", "--backends", "piecewise,full,breakable,graph-trees", "--variants",
               "inductor,inductor-released", "--layers", "1", "--max-tokens", "8", "--repeats", "1", "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    assert "compile" in capsys.readouterr().out.splitlines()[0].split()  # the table's header: compile / s
    rows = {(r["backend"], r["variant"]): r for r in json.loads((tmp_path / "bench.json").read_text())["rows"]}
    assert set(rows) == {("piecewise", "inductor"), ("full", "inductor"), ("piecewise", "inductor-released"),
                         ("full", "inductor-released"), ("graph-trees", "reference")}
    for row in rows.values():
        assert row["model"] == "llama" and row["num_sizes"] == 2 and row["fallbacks"] == 0
        assert row["compile_s"] > 0 and row["capture_s"] >= 0
        assert row["max_abs_err"] < 1e-4  # fp32 on CPU: Inductor vs the uncompiled model
    assert rows[("piecewise", "inductor")]["output_mode"] == "on"
    assert rows[("piecewise", "inductor-released")]["output_mode"] == "released"
    assert rows[("graph-trees", "reference")]["resident_output_bytes"] == 0
    # the plot: Graph Trees (run for real, on CPU the compile without mode) is its own group
    groups = plot_groups([BenchRow.from_dict(r) for r in rows.values()], graph_memory=False)
    assert [(g.backend, g.reference) for g in groups] == [("piecewise", False), ("full", False), ("graph-trees", True)]
    assert [b.variant for b in groups[0].bars] == ["inductor", "inductor-released"]
    assert groups[-1].bars[0].values["memory_mib"] is None and groups[-1].bars[0].values["replay_ms"] > 0
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_variants_for() -> None:
    assert variants_for("graph-trees", ["off", "on"]) == ["reference"]
    assert variants_for("breakable", ["on", "inductor"]) == ["on"]
    assert variants_for("full", ["on", "inductor"]) == ["on", "inductor"]


def test_inductor_options_are_checked() -> None:
    with pytest.raises(TypeError, match="inductor must be a bool"):
        create_backend("piecewise", inductor="yes")
    with pytest.raises(ValueError, match="inductor_config is given but inductor=False"):
        create_backend("piecewise", inductor_config={"max_autotune": True})
    with pytest.raises(ValueError, match="triton.cudagraphs must stay off"):
        create_backend("piecewise", inductor=True, inductor_config={"triton.cudagraphs": True})
    backend = create_backend("piecewise", inductor=True, inductor_config={"max_autotune": False})
    assert isinstance(backend, PiecewiseBackend) and backend.inductor
    off = create_backend("piecewise")
    assert isinstance(off, PiecewiseBackend)
    assert not off.inductor and off.num_piece_compilations == 0 and off.inductor_seconds == 0.0
    assert off.compile_seconds == 0.0


def test_dense_fresh_makes_only_fresh_outputs_with_gaps_contiguous() -> None:
    arg = torch.randn(4, 6)
    fresh = torch.randn(4, 6)
    result = (fresh[:, :3], arg[:, :3], fresh, 7, fresh.t())
    out = dense_fresh(result, (arg,))
    assert out[0].is_contiguous() and torch.equal(out[0], fresh[:, :3])
    assert out[1] is result[1]  # aliases an argument: passed as is
    assert out[2] is fresh and out[3] == 7
    assert out[4] is result[4]  # transposed but dense: empty_like keeps its strides, no copy
    assert torch.empty_like(result[4]).stride() == result[4].stride()
    same = (fresh, fresh.t())
    assert dense_fresh(same, (arg,)) is same


def test_compiled_piece_keeps_the_piece_structure() -> None:
    assert CompiledPiece(lambda a: [a[0], a[1]], returns_tuple=True).boxed([1, 2]) == (1, 2)
    t = torch.ones(1)
    assert CompiledPiece(lambda a: [a[0]], returns_tuple=False).boxed([t]) is t  # one value: a 1-tuple for Inductor
    boxed = CompiledPiece(lambda args: [args.pop(), len(args)], returns_tuple=True)
    args = [t, t]
    assert boxed.boxed(args) == (t, 1) and args == [t]  # the boxed callable owns the list


def test_pieces_need_dynamos_fake_mode() -> None:
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    with pytest.raises(RuntimeError, match="needs dynamo's fake mode"):
        InductorPieces().compile(gm, [torch.ones(2)], ["x"], [])


def test_canonical_strides_of_size_one_dims() -> None:
    base = torch.zeros(1, 64)
    view = base[:, :8]  # stride (64, 1): contiguous, odd stride on the size-1 dim
    fixed = _canonical(view)
    assert fixed.stride() == (8, 1) and fixed.data_ptr() == view.data_ptr()
    assert _canonical(base) is base
    strided = torch.zeros(4, 8)[:, :4]
    assert _canonical(strided) is strided


def test_batch_first_slices_compile_once() -> None:
    """``ids[:, :s]`` of a ``[1, max]`` buffer: one compilation for every size (no stride guard)."""
    torch._dynamo.reset()
    backend = create_backend("piecewise", options=BackendOptions(engine="eager"), splitting_ops=[mix])
    assert isinstance(backend, PiecewiseBackend)
    fn = backend.compile(lambda x, scale: mix(x * scale) + 1.0, dynamic_dim=1)
    x, scale = torch.randn(1, 32), torch.tensor([2.0])  # scale has no dim 1: left static
    with torch.no_grad():
        for s in (32, 16, 5, 1):
            torch.testing.assert_close(fn(x[:, :s], scale), torch.tanh(x[:, :s] * 2.0) + 2.0)
    assert backend.num_compilations == 1
    with pytest.raises(ValueError, match="dynamic_dim must be an int >= 0"):
        backend.compile(lambda x: x, dynamic_dim=-1)
    torch._dynamo.reset()


class Heads(torch.nn.Module):
    """Attention's layout change around a splitting op: a ``[seq, heads * d]`` projection viewed
    as ``[heads, seq, d]`` (a transposed, dense view) crosses the call."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.register_buffer("w", torch.randn(H, 2 * H, generator=g) / H**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = (x @ self.w).view(x.shape[0], 2, H).transpose(0, 1) * 0.5  # [heads, seq, d], not contiguous
        a = heads_mix(q)  # [seq, heads, d]
        return a.reshape(x.shape[0], 2 * H) * 2.0 + 1.0


def test_a_transposed_value_crosses_a_split_without_a_copy() -> None:
    """A piece's output in the eager layout (dense, transposed) reaches the splitting op as it
    is, at capture and replay (no dense copy); replay equals the model after the input changed."""
    torch._dynamo.reset()
    backend = create_backend(
        "piecewise", options=BackendOptions(engine="eager", output_mode="on"), splitting_ops=[heads_mix], inductor=True
    )
    model = Heads()
    fn = backend.compile(model)
    x = torch.randn(max(SIZES), H)
    SEEN_CONTIGUOUS.clear()
    with torch.no_grad(), backend.capture_session():
        for s in SIZES:
            backend.capture_one(ShapeKey(s), lambda s=s: fn(x[:s]), capture_inputs=x)
    x.copy_(torch.randn_like(x))
    for s in SIZES:
        got = backend.replay(ShapeKey(s)).clone()
        with torch.no_grad():
            torch.testing.assert_close(got, model(x[:s]), rtol=1e-5, atol=1e-5)
    # every capture and replay called the op; each saw the transposed view as it is, except at
    # size 1 (a [2, 1, H] view is contiguous)
    assert [n for n, _ in SEEN_CONTIGUOUS if n == 1] and len(SEEN_CONTIGUOUS) >= 2 * len(SIZES)
    assert not any(contiguous for n, contiguous in SEEN_CONTIGUOUS if n > 1)
    backend.cleanup()
    torch._dynamo.reset()


@pytest.mark.parametrize("inductor", [True, False], ids=["inductor", "fx"])
def test_a_compiled_piece_frees_an_input_after_its_last_use(inductor: bool) -> None:
    """The program hands a piece its arguments boxed and keeps no reference: Inductor's code
    drops the splitting op's result after its last use, before the rest of the piece runs (a
    whole-model graph frees it there too); the FX pieces hold it to the end, as before."""
    torch._dynamo.reset()
    backend = create_backend(
        "piecewise", options=BackendOptions(engine="eager"), splitting_ops=[fresh_triple], inductor=inductor
    )

    def forward(x: torch.Tensor) -> torch.Tensor:
        a = fresh_triple(x)
        return probe_expired(torch.relu(a * 2.0)) * 2.0  # a's last use is before the probe

    fn = backend.compile(forward)
    x = torch.randn(8, 4)
    MADE.clear()
    EXPIRED.clear()
    with torch.no_grad():
        torch.testing.assert_close(fn(x), (torch.relu(x * 6.0) + 1.0) * 2.0)
    assert EXPIRED == [inductor]
    torch._dynamo.reset()
