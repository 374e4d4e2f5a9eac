"""Hooks really applied by SGLang's own ``load_plugins()``, each check in a fresh process.

SGLang logs and swallows plugin errors, so every test asserts on ``HookRegistry`` state and on
behaviour. HookRegistry patches are permanent per process: hence the child processes (forked
before any plugin is loaded: ``conftest.run_child``). Our entry point is discovered from a
``*.dist-info`` written from ``pyproject.toml`` (fixture ``dist_dir``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import run_child

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

APPLY_AND_RESOLVE = """
import os, pkgutil
from types import SimpleNamespace as NS
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang_bcg_plugin.sglang.compat import seam_kind
from sglang_bcg_plugin.sglang.hooks import hooks_for
load_plugins()
patched = sorted(HookRegistry._patched)
hook_counts = {t: len(h) for t, h in HookRegistry._hooks.items()}
import sglang_bcg_plugin.sglang as integration
integration.register()
load_plugins()
again = {t: len(h) for t, h in HookRegistry._hooks.items()}
kind = seam_kind()
all_targets = sorted(t for t, _, _ in hooks_for(kind))
targets = [t for t in all_targets if t in hook_counts]  # the switch's: only where used (hooks.wanted)

def is_wrapped(target):
    owner, _, name = target.rpartition(".")
    obj = pkgutil.resolve_name(owner)
    attr = obj.__dict__.get(name) if isinstance(obj, type) else getattr(obj, name)
    return hasattr(getattr(attr, "__func__", attr), "__wrapped__")
wrapped = {t: is_wrapped(t) for t in targets}

from sglang.srt.server_args import ServerArgs, prepare_server_args
flags = {}
for argv in ([], ["--enable-bcg-shared-output"], ["--no-enable-bcg-shared-output"],
             ["--enable-bcg-shared-output=released"], ["--enable-bcg-shared-output", "OFF"]):
    os.environ["SGLANG_ENABLE_BCG_SHARED_OUTPUT"] = "Off" if not argv else "unchanged"
    sa = prepare_server_args(["--model-path", "dummy", *argv])
    flags[" ".join(argv) or "none"] = [getattr(sa, "_bcg_shared_output", None), os.environ["SGLANG_ENABLE_BCG_SHARED_OUTPUT"]]
import contextlib, io
err = io.StringIO()
with contextlib.redirect_stderr(err):
    try:
        prepare_server_args(["--model-path", "dummy", "--enable-bcg-shared-output=sometimes"])
    except SystemExit as exc:
        flags["bad"] = [exc.code, err.getvalue().strip().splitlines()[-1]]

propagated, resolved = [], {}
if kind == "backend":
    import sglang.srt.model_executor.runner_backend.utils as u
    import sglang.srt.model_executor.runner_backend as rb
    import sglang.srt.model_executor.runner.prefill_cuda_graph_runner as pr
    import sglang.srt.model_executor.runner.decode_cuda_graph_runner as dr
    propagated = [pr.resolve_prefill_backend is u.resolve_prefill_backend is rb.resolve_prefill_backend,
                  dr.resolve_decode_backend is u.resolve_decode_backend]
    # SGLang's resolver, as its runners call it (config stubbed: nothing is published here).
    from sglang.srt.model_executor.cuda_graph_config import Backend
    from conftest import tp_group_installed
    from cpu_graph_standin import FakeGroup, FakeRunner
    tp_group_installed(FakeGroup(), permanently=True).__enter__()
    for prefill, decode, debug in ((Backend.BREAKABLE, Backend.FULL, False), (Backend.FULL, Backend.BREAKABLE, True)):
        cfg = NS(prefill=NS(backend=prefill), decode=NS(backend=decode))
        exec_ = NS(graph=NS(cuda_graph_config=cfg, debug_cuda_graph=debug), features=NS(enable_memory_saver=False))
        u.get_exec = lambda: exec_  # 0.5.19+ read the published config; older ones the server args
        server_args = NS(cuda_graph_config=cfg, enable_memory_saver=False, debug_cuda_graph=debug)
        for name, fn in (("prefill", pr.resolve_prefill_backend), ("decode", dr.resolve_decode_backend)):
            try:
                b = fn(FakeRunner(server_args=server_args))
            except Exception as exc:  # SGLang's own non-breakable backends need a real runner
                resolved[f"{name}-{prefill if name == 'prefill' else decode}"] = [f"error: {type(exc).__name__}", [], None]
                continue
            resolved[f"{name}-{prefill if name == 'prefill' else decode}"] = [type(b).__name__, [c.__name__ for c in type(b).__mro__][:3], b.__dict__.get("_debug_eager")]
report(kind=kind, targets=targets, all_targets=all_targets, patched=patched, hook_counts=hook_counts, again=again, wrapped=wrapped, propagated=propagated, flags=flags, resolved=resolved)
"""


def test_load_plugins_applies_every_hook(dist_dir: Path) -> None:
    r = run_child(APPLY_AND_RESOLVE, dist_dir).result
    assert r["patched"] == r["targets"]
    # This interpreter is no scheduler (the switch's RPC hook is not registered); it registers the
    # switch's HTTP hook where FastAPI is installed (as SGLang's launcher does).
    # The memory plan's and the incremental capture's hooks are registered only where asked
    # (tests/sglang/test_memory_plan_seam.py, tests/sglang/test_incremental.py).
    from sglang_bcg_plugin.sglang import incremental
    from sglang_bcg_plugin.sglang.memory_plan import RESIZE_TARGET
    from sglang_bcg_plugin.sglang.switch.routes import HTTP_TARGET
    from sglang_bcg_plugin.sglang.switch.rpc import RPC_TARGET

    asked_only = {RESIZE_TARGET, incremental.START_TARGET, incremental.CAPTURE_TARGET, incremental.CAN_RUN_TARGET,
                  incremental.STEP_TARGET}
    unregistered = set(r["all_targets"]) - set(r["targets"]) - asked_only
    assert unregistered in ({RPC_TARGET}, {RPC_TARGET, HTTP_TARGET})
    assert len(r["all_targets"]) == (11 if r["kind"] == "backend" else 6)
    assert r["hook_counts"] == r["again"] == {t: 1 for t in r["targets"]}  # register()/load_plugins() again: no-op
    assert all(r["wrapped"].values()), r["wrapped"]
    assert r["flags"] == {
        "none": [None, "Off"],  # not given: env var left to the operator
        "--enable-bcg-shared-output": [None, "1"],  # given: the env var is its one carrier
        "--no-enable-bcg-shared-output": [None, "0"],
        "--enable-bcg-shared-output=released": [None, "released"],
        "--enable-bcg-shared-output OFF": [None, "0"],
        "bad": [2, r["flags"]["bad"][1]],
    }
    assert "--enable-bcg-shared-output='sometimes' is not an output mode" in r["flags"]["bad"][1]
    if r["kind"] == "runner":  # 0.5.13: BreakableCudaGraphRunner's two methods, no resolver
        assert [t.rsplit(".", 1)[1] for t in r["targets"] if ".BreakableCudaGraphRunner." in t] == ["_capture_all", "_capture_one"]
        return
    assert r["propagated"] == [True, True]  # the runners call the wrapper
    bcg = ["SGLangBreakableBackend", "SharingPolicyMixin", "BreakableCudaGraphBackend"]
    assert r["resolved"]["prefill-breakable"][:2] == ["SGLangBreakableBackend", bcg]
    assert r["resolved"]["decode-breakable"] == ["SGLangBreakableBackend", bcg, True]  # debug_eager kept
    assert "SGLangBreakableBackend" not in (r["resolved"]["decode-full"][0], r["resolved"]["prefill-full"][0])


def test_launch_server_help_lists_flag(dist_dir: Path) -> None:
    code = """
import runpy, sys
sys.argv = ["sglang.launch_server", "--help"]
try:
    runpy.run_module("sglang.launch_server", run_name="__main__")
except SystemExit as exc:
    assert exc.code == 0, exc.code
report(ok=True)
"""
    out = run_child(code, dist_dir).stdout
    assert "--enable-bcg-shared-output [{on,off,released}]" in out and "--no-enable-bcg-shared-output" in out
    assert "SGLANG_ENABLE_BCG_SHARED_OUTPUT" in out


def test_flag_reaches_spawned_child(dist_dir: Path) -> None:
    """The parsed flag reaches a ``spawn``-ed process that runs ``load_plugins()`` (as SGLang's
    scheduler does) by its one carrier, the inherited env var."""
    code = """
import multiprocessing as mp, os
from sglang.srt.plugins import load_plugins
from sglang.srt.server_args import prepare_server_args
from spawn_target import scheduler_like
load_plugins()
sa = prepare_server_args(["--model-path", "dummy", "--enable-bcg-shared-output"])
ctx = mp.get_context("spawn")
queue = ctx.Queue()
proc = ctx.Process(target=scheduler_like, args=(sa, queue))
proc.start()
child = queue.get(timeout=120)
proc.join(60)
report(child=child, exitcode=proc.exitcode)
"""
    r = run_child(code, dist_dir, timeout=180).result
    assert r["exitcode"] == 0
    assert r["child"] == {
        "plugins_patched": True,
        "env": "1",
        "stash": None,  # nothing rides on the pickled ServerArgs
        "mode": "on",  # resolve_output_mode(): the env var carries it
    }
