"""The memory plan against the installed SGLang: its hook applied by SGLang's own ``load_plugins()`` where
asked and where the release backs the KV pool after capture (0.5.16+), and the release's headroom arithmetic
still the one the plan steers (``memory_plan.holding_back``)."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

from conftest import run_child
from sglang_bcg_plugin.sglang import memory_plan as mp
from sglang_bcg_plugin.sglang.hooks import has_post_capture_sizing

pytestmark = [pytest.mark.sglang]

APPLY = """
import os, logging, io
os.environ.pop("SGLANG_ENABLE_POST_CAPTURE_KV_SIZING", None)
os.environ["SGLANG_BCG_MEMORY_PLAN"] = "1"
stream = io.StringIO()
logging.getLogger().addHandler(logging.StreamHandler(stream))
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang_bcg_plugin.sglang.memory_plan import RESIZE_TARGET
load_plugins()
report(registered=RESIZE_TARGET in HookRegistry._hooks, patched=RESIZE_TARGET in HookRegistry._patched,
       post_capture=os.environ.get("SGLANG_ENABLE_POST_CAPTURE_KV_SIZING"), failed="Failed to apply" in stream.getvalue())
"""


@pytest.mark.slow
def test_load_plugins_applies_the_plan_where_asked(dist_dir: Path) -> None:
    r = run_child(APPLY, dist_dir).result
    # asked, where the release has it: SGLang's post-capture sizing on, in every process
    assert r["post_capture"] == ("1" if has_post_capture_sizing() else None)
    assert r["registered"] == r["patched"] == has_post_capture_sizing()
    assert not r["failed"]


def resize_function():
    runtime = pytest.importorskip(mp.RUNTIME_MODULE)  # 0.5.16+
    return runtime, runtime.compute_post_capture_kv_resize


def test_the_release_headroom_is_what_the_plan_steers() -> None:
    """Every term of the release's ``headroom_gb`` is one the plan sets or includes: the fraction's, the
    activation reserve (replaced while SGLang sizes), SGLang's sampler measurement (a part of the plan), a
    Mamba reserve (only for Mamba models, which the docs name)."""
    _, fn = resize_function()
    tree = ast.parse(inspect.cleandoc("\n" + inspect.getsource(fn)))
    terms = [ast.unparse(node.value) for node in ast.walk(tree) if isinstance(node, ast.Assign)
             and any(isinstance(t, ast.Name) and t.id == "headroom_gb" for t in node.targets)]
    assert terms, "the release no longer names its headroom headroom_gb"
    assert terms[0].replace(" ", "").replace("\n", "").startswith(
        "model_runner.pre_model_load_memory*(1-model_runner.mem_fraction_static)")
    known = (mp.RESERVE_FUNCTION + "(", "sampling_headroom_bytes", "mamba_pre_capture_reserve_mb")
    for term in terms[1:]:
        assert term.startswith("max(headroom_gb,") and any(k in term for k in known), term


def test_holding_back_sets_and_restores() -> None:
    runtime, _ = resize_function()
    had = getattr(runtime, mp.RESERVE_FUNCTION, None)
    runner = NS(pre_model_load_memory=78.5, mem_fraction_static=0.98)
    reserve = 5 * mp.GiB
    with mp.holding_back(runner, reserve):
        assert runner.pre_model_load_memory * (1 - runner.mem_fraction_static) == pytest.approx(5.0)
        if had is not None:
            assert getattr(runtime, mp.RESERVE_FUNCTION)(80.0) / 1024 == pytest.approx(5.0)
    assert runner.mem_fraction_static == 0.98
    assert getattr(runtime, mp.RESERVE_FUNCTION, None) is had
    with pytest.raises(KeyError), mp.holding_back(runner, reserve):
        raise KeyError  # restored on an error too
    assert runner.mem_fraction_static == 0.98 and getattr(runtime, mp.RESERVE_FUNCTION, None) is had


def test_the_logprob_chunk_read_from_the_release() -> None:
    envs = getattr(importlib.import_module("sglang.srt.environ"), "envs", None)
    size = getattr(envs, "SGLANG_LOGPROB_CHUNK_SIZE", None)
    expected = min(8192, int(size.get())) if size is not None and envs.SGLANG_ENABLE_LOGPROB_CHUNK.get() else 8192
    assert mp.logprob_chunk_tokens(8192) == expected
    assert mp.logprob_chunk_tokens(100) == 100
