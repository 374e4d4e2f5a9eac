"""Named errors, not deep tracebacks: odd outputs, typo'd plugins, option spellings (issue 18)."""

from __future__ import annotations

from sglang_bcg_plugin.output_mode import mode_of_option

import dataclasses
import math
import sys
import textwrap
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from sglang_bcg_plugin import BackendOptions, ShapeKey, available_backends, broken_plugins, create_backend
from sglang_bcg_plugin.breaks import graph_break
from sglang_bcg_plugin.errors import PluginLoadWarning, user_stacklevel, warn_user
from sglang_bcg_plugin.manager import get_plugin_manager, reset_plugin_manager
from sglang_bcg_plugin.report import KeyReport, MemoryReport
from sglang_bcg_plugin.scan import SCAN_LIMIT, cut, short_repr, walk_tensors
from sglang_bcg_plugin.sharing import SharedOutputFallbackWarning
from sglang_bcg_plugin.trees import MAX_DEPTH, collect_tensors, diff, flatten

SIZES = (8, 4, 2)


def _capture(forward_of: Callable[[int], Callable[[], Any]], share: bool | str = True, sizes: tuple[int, ...] = SIZES,
             backend: str = "full", **opts: Any) -> Any:
    b = create_backend(backend, options=BackendOptions(output_mode=mode_of_option(share), engine="eager", **opts))  # type: ignore[arg-type]
    with torch.no_grad(), b.capture_session():
        for n in sizes:
            b.capture_one(ShapeKey(n), forward_of(n))
    return b


# -- item 1: a plugin with a typo'd hook name is isolated like a wrong signature ----------------------------------------

TYPO = """
    from sglang_bcg_plugin import hookimpl

    @hookimpl
    def sglang_bcg_register_backend(registry):
        raise AssertionError("never called")
"""

BADSIG = """
    from sglang_bcg_plugin import hookimpl

    @hookimpl
    def sglang_bcg_register_backends(registry, not_a_hook_argument):
        raise AssertionError("never called")
"""


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str, str, str], None]]:
    """Install a one-module distribution with an entry point of group ``sglang_bcg``."""
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))

    def add(dist: str, module: str, source: str, ep_name: str | None = None) -> None:
        (root / f"{module}.py").write_text(textwrap.dedent(source))
        info = root / f"{dist}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text(f"[sglang_bcg]\n{ep_name or module} = {module}\n")

    yield add  # type: ignore[misc]
    for mod in [m for m in sys.modules if m.startswith("thirdparty_")]:
        del sys.modules[mod]


def test_typo_hook_name_is_isolated_and_builtins_work(site: Callable[..., None]) -> None:
    site("thirdparty-typo", "thirdparty_typo", TYPO, "typo")
    reset_plugin_manager()
    with pytest.warns(PluginLoadWarning) as caught:
        backend = create_backend("full", options=BackendOptions(engine="eager"))
    assert backend.name == "full"
    msg = str(caught[0].message)
    assert "unknown hook 'sglang_bcg_register_backend' in plugin 'typo'" in msg
    assert "did you mean 'sglang_bcg_register_backends'?" in msg
    assert "SGLANG_BCG_BLOCK_PLUGINS=typo" in msg
    assert caught[0].filename == __file__  # the user's line, not manager.py
    (b,) = broken_plugins()
    assert (b.entry_point, b.distribution) == ("typo", "thirdparty-typo")
    assert b.error.startswith("PluginValidationError: unknown hook 'sglang_bcg_register_backend'")
    assert not get_plugin_manager().has_plugin("typo")
    assert {"breakable", "full", "piecewise"} <= set(available_backends())


def test_unknown_hook_without_a_close_name_lists_the_known_hooks(site: Callable[..., None]) -> None:
    site("thirdparty-odd", "thirdparty_odd", TYPO.replace("sglang_bcg_register_backend", "zzz_qqq"), "odd")
    reset_plugin_manager()
    with pytest.warns(PluginLoadWarning, match="unknown hook 'zzz_qqq'"):
        get_plugin_manager()
    (b,) = broken_plugins()
    assert "did you mean" not in b.error and "known hooks: sglang_bcg_capture_finished" in b.error


def test_optional_unknown_hook_is_allowed(site: Callable[..., None]) -> None:
    src = """
        from sglang_bcg_plugin import hookimpl

        @hookimpl(optionalhook=True)
        def sglang_bcg_some_future_hook():
            pass
    """
    site("thirdparty-optional", "thirdparty_optional", src, "optional")
    reset_plugin_manager()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert get_plugin_manager().has_plugin("optional")
    assert broken_plugins() == ()


@pytest.mark.parametrize(("source", "needle"), [(TYPO, "unknown hook"), (BADSIG, "not_a_hook_argument")])
def test_backends_command_prints_one_broken_line(
    site: Callable[..., None], capsys: pytest.CaptureFixture[str], source: str, needle: str
) -> None:
    from sglang_bcg_plugin.cli import main

    site("thirdparty-bad", "thirdparty_bad", source, "bad")
    reset_plugin_manager()
    assert main(["backends"]) == 1
    lines = capsys.readouterr().out.splitlines()
    broken = [line for line in lines if "bad" in line]
    assert len(broken) == 1 and broken[0].startswith("BROKEN bad (thirdparty-bad 1.0): PluginValidationError")
    assert needle in broken[0]
    assert lines[:3] == ["breakable\tsglang_bcg_plugin.backends.breakable", "full\tsglang_bcg_plugin.backends.full",
                         "piecewise\tsglang_bcg_plugin.backends.piecewise"]


# -- item 2: grad-requiring, sparse, too deep, NaN ---------------------------------------------------------------------

def test_grad_requiring_output_with_sharing_is_a_named_error_at_capture() -> None:
    emb = torch.nn.Embedding(16, 4)
    b = create_backend("full", options=BackendOptions(output_mode="on", engine="eager"))
    with b.capture_session(), pytest.raises(ValueError, match=r"ShapeKey\(size=8.* at leaf output requires grad") as info:
        b.capture_one(ShapeKey(8), lambda: emb.weight[:8])
    assert "torch.no_grad()" in str(info.value) and "output.detach()" in str(info.value)
    assert not b.can_run(ShapeKey(8))


def test_grad_requiring_output_is_fine_under_no_grad_and_with_sharing_off() -> None:
    emb = torch.nn.Embedding(16, 4)
    b = _capture(lambda n: lambda: emb.weight[:n] * 2)
    torch.testing.assert_close(b.replay(ShapeKey(4)), emb.weight[:4].detach() * 2)
    off = create_backend("full", options=BackendOptions(output_mode="off", engine="eager"))
    with off.capture_session():
        out = off.capture_one(ShapeKey(8), lambda: emb.weight[:8] * 2)
    assert out.requires_grad  # sharing off hands out the output as the forward made it


@pytest.mark.parametrize("share", [True, False])
def test_sparse_output_is_a_type_error_at_capture(share: bool) -> None:
    with pytest.raises(TypeError, match=r"unsupported output tensor at output\[1\]: layout sparse_coo.*to_dense"):
        _capture(lambda n: lambda: (torch.ones(n), torch.eye(n).to_sparse()), share=share)


def test_nested_tensor_output_is_a_type_error() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: nested tensors are a prototype
        nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with pytest.raises(TypeError, match="layout nested"):
        flatten({"x": nested})


def test_deep_output_is_a_type_error_naming_the_limit() -> None:
    def deep(n: int) -> Callable[[], Any]:
        def fwd() -> Any:
            out: Any = [torch.ones(n)]
            for _ in range(3000):
                out = [out]
            return out

        return fwd

    with pytest.raises(TypeError, match=f"nested deeper than {MAX_DEPTH} levels") as info:
        _capture(deep)
    assert len(str(info.value)) < 600
    ok: Any = torch.ones(2)
    for _ in range(MAX_DEPTH):
        ok = [ok]
    assert len(flatten(ok)[1]) == 1  # exactly MAX_DEPTH levels is fine


@pytest.mark.parametrize("share", [True, False])
def test_nan_leaf_value_replays(share: bool) -> None:
    x = torch.randn(8)
    b = _capture(lambda n: lambda: (x[:n] * 2, float("nan"), complex("nan+1j")), share=share)
    x.copy_(torch.randn(8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t, nan, cnan = b.replay(ShapeKey(4))
    torch.testing.assert_close(t, x[:4] * 2)
    assert math.isnan(nan) and math.isnan(cnan.real)
    assert b.memory_report().fallbacks == {}


def test_nan_differs_from_a_number() -> None:
    found = diff(flatten((float("nan"),))[0], flatten((1.0,))[0])
    assert found == ("output[0]", "non-tensor leaf value changed: expected nan, got 1.0")


# -- item 3: containers the tree code cannot rebuild are refused at capture --------------------------------------------

class Holder:
    def __init__(self, x: Any) -> None:
        self.x = x


class Slotted:
    __slots__ = ("a", "b")

    def __init__(self, a: Any) -> None:
        self.a = a  # b stays unset


class SubSlotted(Slotted):
    __slots__ = ("c", "__weakref__")

    def __init__(self, c: Any) -> None:
        super().__init__(None)
        self.c = c


class Plain:
    """No __eq__ (compared by identity) and a 5000-character repr."""

    def __init__(self) -> None:
        self.blob = "y" * 5000

    def __repr__(self) -> str:
        return f"Plain({self.blob})"


@pytest.mark.parametrize(
    ("make", "type_name", "where"),
    [
        (lambda t: Holder([t]), "Holder", "output.x[0]"),
        (lambda t: Holder({"k": (1, t)}), "Holder", "output.x['k'][1]"),
        (lambda t: Slotted(t), "Slotted", "output.a"),
        (lambda t: SubSlotted(t), "SubSlotted", "output.c"),
        (lambda t: {t}, "set", "output{...}"),
        (lambda t: frozenset([Holder(t)]), "frozenset", "output{...}.x"),
    ],
)
@pytest.mark.parametrize("share", [True, False])
def test_unsupported_container_holding_tensors_is_refused_at_capture(
    make: Callable[[torch.Tensor], Any], type_name: str, where: str, share: bool
) -> None:
    x = torch.randn(8)
    with pytest.raises(TypeError) as info:
        _capture(lambda n: lambda: (x[:n] * 1, make(x[:n] * 2)), share=share)
    msg = str(info.value)
    assert f"unsupported output type {type_name} at output[1]: it holds a tensor (at {where.replace('output', 'output[1]', 1)})" in msg
    assert "tuples, lists, named tuples, dicts, dataclasses" in msg


def test_set_of_plain_values_is_a_value_leaf() -> None:
    x = torch.randn(8)
    b = _capture(lambda n: lambda: (x[:n] * 1, {1, 2, "a"}, frozenset({3.5})))
    x.copy_(torch.randn(8))
    out = b.replay(ShapeKey(2))
    assert out[1] == {1, 2, "a"} and out[2] == frozenset({3.5})
    torch.testing.assert_close(out[0], x[:2])


def test_fallback_warning_cuts_object_reprs_and_points_at_the_caller() -> None:
    x = torch.randn(8)
    b = create_backend("full", options=BackendOptions(output_mode="on", engine="eager"))
    with torch.no_grad(), b.capture_session():
        b.capture_one(ShapeKey(8), lambda: (x * 1, Plain()))
        with pytest.warns(SharedOutputFallbackWarning) as caught:
            b.capture_one(ShapeKey(4), lambda: (x[:4] * 1, Plain()))
    (w,) = caught
    assert w.filename == __file__
    assert "non-tensor leaf value changed" in str(w.message) and len(str(w.message)) < 600
    assert "Plain(yyy" in str(w.message) and "y" * 300 not in str(w.message)
    found = diff(flatten(("z" * 5000,))[0], flatten(("w" * 5000,))[0])
    assert found is not None and len(found[1]) < 500 and "..." in found[1]


def test_short_repr_and_cut() -> None:
    class Loud:
        def __repr__(self) -> str:
            raise RuntimeError("no repr")

    assert short_repr(Loud()).startswith("<") and "Loud" in short_repr(Loud())
    assert len(short_repr(list(range(10_000)))) < 200
    assert cut("abc", 10) == "abc" and cut("a" * 50, 10) == "a" * 7 + "..."


def test_scan_is_bounded_and_cycle_safe() -> None:
    loop: list[Any] = []
    loop.append(loop)
    assert list(walk_tensors(loop)) == []
    many = Holder([Holder(i) for i in range(2 * SCAN_LIMIT)] + [torch.ones(1)])
    assert list(walk_tensors(many)) == []  # gives up after SCAN_LIMIT objects: never raises


@dataclasses.dataclass(slots=True)
class Batch:
    ids: torch.Tensor
    other: Any = None


def test_collect_tensors_sees_slots_sets_and_dicts() -> None:
    a, b, c, d = (torch.ones(1) for _ in range(4))
    found = collect_tensors({"batch": Batch(a, other=Slotted(b)), "set": {c}, "tuple": (d, d)})
    assert {id(t) for t in found} == {id(a), id(b), id(c), id(d)}


# -- item 4: graph_break(reads="out") ---------------------------------------------------------------------------------

def test_graph_break_takes_one_string_as_one_name() -> None:
    @graph_break(reads="x", writes="out")
    def attn(x: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(x)

    x, out = torch.ones(2), torch.zeros(2)
    attn(x, out)
    assert out.tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match=r"name \['nope'\], which are not parameters"):
        graph_break(reads="nope")(attn.__wrapped__)  # type: ignore[attr-defined]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"reads": 3}, r"graph_break\(reads=...\) takes parameter names .*got 3 with 3 of type int"),
    ({"writes": ("out", None)}, r"graph_break\(writes=...\) .*None of type NoneType"),
])
def test_graph_break_rejects_non_names(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(TypeError, match=match):
        graph_break(**kwargs)


def test_bare_graph_break_decorates() -> None:
    @graph_break
    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    assert double(torch.ones(1)).item() == 2.0 and double.__sglang_bcg_break__  # type: ignore[attr-defined]


def test_graph_break_positional_string_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"pass names as keywords: @graph_break\(reads=\('out',\)\)"):
        graph_break("out")  # type: ignore[call-overload]


# -- item 5: one rule for the buffer source's spelling ----------------------------------------------------------------

@pytest.mark.parametrize(("raw", "value"), [("ADOPT", "adopt"), (" Reserve ", "reserve"), ("Auto", "auto")])
def test_shared_buffer_is_case_insensitive_like_the_env_variable(raw: str, value: str) -> None:
    options = BackendOptions(shared_buffer=raw)  # type: ignore[arg-type]
    assert options.shared_buffer == value
    assert options == BackendOptions(shared_buffer=value)  # type: ignore[arg-type]


@pytest.mark.parametrize(("raw", "error", "match"), [
    ("pool", ValueError, r"shared_buffer='pool' is not a buffer source; use one of 'auto', 'adopt' or 'reserve' \(any case\)"),
    (1, TypeError, "got 1 of type int"),
])
def test_shared_buffer_errors(raw: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        BackendOptions(shared_buffer=raw)  # type: ignore[arg-type]


# -- item 6: warnings point at the user's line ------------------------------------------------------------------------

def test_user_stacklevel_skips_package_frames() -> None:
    with pytest.warns(UserWarning, match="hello") as caught:
        warn_user("hello", UserWarning)
    assert caught[0].filename == __file__
    assert user_stacklevel() == 1  # called from outside the package: this very frame


# -- item 7: pluralisation --------------------------------------------------------------------------------------------

def test_memory_report_says_one_key() -> None:
    key = KeyReport(ShapeKey(1), 4, 4, False, None, None, None, 1)
    assert ": 1 key, " in MemoryReport.from_keys("full", "eager", [key]).format()
    assert ": 2 keys, " in MemoryReport.from_keys("full", "eager", [key, key]).format()
    assert ": 0 keys, " in MemoryReport("full", "eager").format()


# -- issue 53: errors that name their cause ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["full", "breakable"])
def test_replaying_a_size_captured_on_another_stream_names_the_streams(name: str) -> None:
    x = torch.randn(12, 3)
    b = create_backend(name, options=BackendOptions(output_mode="on", engine="eager"))
    with torch.no_grad(), b.capture_session():
        for key in (ShapeKey(12, 3), ShapeKey(6, 3), ShapeKey(6, 5), ShapeKey(2)):
            b.capture_one(key, lambda n=key.size: x[:n] + 1)
    with pytest.raises(KeyError) as info:
        b.replay(ShapeKey(12, 4))
    text = info.value.args[0]
    assert "size 12 was captured for stream_idx=3 but not for stream_idx=4" in text
    assert "stream_idx=None: [2]; stream_idx=3: [6, 12]; stream_idx=4: none; stream_idx=5: [6]" in text
    with pytest.raises(KeyError, match=r"size 6 was captured for stream_idx=3, stream_idx=5 but not for stream_idx=None"):
        b.replay(ShapeKey(6))
    with pytest.raises(KeyError) as info:
        b.replay(ShapeKey(12, 3, "lora-a"))
    assert "size 12 was captured for variant_label=None but not for variant_label='lora-a'" in info.value.args[0]
    assert "stream_idx" not in info.value.args[0].split("; captured sizes")[0].split("was never captured")[1]
    with pytest.raises(KeyError, match=r"never captured by the .* backend; captured sizes: \[2, 6, 12\] \(stream_idx=None"):
        b.replay(ShapeKey(7, 3))  # no such size anywhere: the sizes per stream


def test_a_key_of_another_type_with_the_same_fields_is_named() -> None:
    @dataclasses.dataclass(frozen=True)
    class HostKey:
        size: int
        stream_idx: int | None = None
        variant_label: str | None = None
        attention_variant: str | None = None

    x = torch.randn(4, 2)
    b = create_backend("full", options=BackendOptions(engine="eager"))
    with b.capture_session():
        b.capture_one(ShapeKey(4), lambda: x * 2)
        b.capture_one(HostKey(2, attention_variant="dense"), lambda: x[:2] * 2)
    with pytest.raises(KeyError, match=r"size 4 was captured with another key type \(ShapeKey\)"):
        b.replay(HostKey(4))
    with pytest.raises(KeyError, match="size 2 was captured for attention_variant='dense' but not for attention_variant="):
        b.replay(HostKey(2, attention_variant="sparse"))
    with pytest.raises(KeyError) as info:
        create_backend("full").replay(ShapeKey(1))
    assert info.value.args[0].endswith("was never captured by the full backend; captured sizes: none")


def test_forecast_error_is_public() -> None:
    import sglang_bcg_plugin
    from sglang_bcg_plugin.errors import ForecastError

    assert sglang_bcg_plugin.ForecastError is ForecastError and "ForecastError" in sglang_bcg_plugin.__all__
    assert issubclass(ForecastError, RuntimeError)
    b = create_backend("full", options=BackendOptions(engine="eager"))
    with pytest.raises(sglang_bcg_plugin.ForecastError):
        b.forecast([8, 4], lambda n: (lambda: torch.ones(n)))


@pytest.mark.parametrize("hook", [0, "barrier", [print]])
def test_a_non_callable_post_warmup_hook_fails_before_any_warmup(hook: object) -> None:
    calls: list[int] = []
    b = create_backend("full", options=BackendOptions(engine="eager"))
    with b.capture_session():
        with pytest.raises(TypeError, match=r"post_warmup_hook must be None or callable .* nothing was warmed up"):
            b.capture_one(ShapeKey(4), lambda: calls.append(1), post_warmup_hook=hook)  # type: ignore[arg-type]
        assert calls == [] and b.captured_keys() == []
        b.capture_one(ShapeKey(4), lambda: torch.ones(4), post_warmup_hook=lambda: calls.append(2))
    assert calls == [2, 2]  # one call per warmup
    with b.capture_session(), pytest.raises(TypeError, match=r"forward_fn must be callable .* got 'x' \(str\)"):
        b.capture_one(ShapeKey(2), "x")  # type: ignore[arg-type]
