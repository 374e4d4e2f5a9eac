"""``sglang-bcg doctor``: is this SGLang install one our hooks fit?

Prints the installed SGLang version, whether every hook target (and each SGLang name our
breakable backend relies on) exists, whether our ``sglang.srt.plugins`` entry point is
discoverable, and the resolved sharing flag. Exit codes: 0 all good, 1 a target or the entry
point is missing, 2 SGLang is not installed. SGLang is imported only inside :func:`doctor_main`.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import pkgutil
import sys
from typing import TextIO

from .hooks import HOOKS
from .sglang_breakable import CAPTURE_VAR, SGLANG_BCG_CLASS

#: The SGLang versions this integration was checked against (the ``[sglang]`` extra pins it).
SUPPORTED_SGLANG = ("0.5.23",)
ENTRY_POINT_GROUP = "sglang.srt.plugins"
ENTRY_POINT_VALUE = "sglang_bcg_plugin.integration:register"

_BCG_MODULE = SGLANG_BCG_CLASS.rsplit(".", 1)[0]
#: Names our breakable backend reads besides the hook targets (a moved one breaks capture).
SEAM_NAMES = (
    SGLANG_BCG_CLASS,
    *(
        f"{_BCG_MODULE}.{n}"
        for n in ("BreakableCUDAGraph", "BreakableCUDAGraphCapture", "eager_on_graph", "graph_pool_capture_scope")
    ),
    "sglang.srt.model_executor.runner_backend.base_cuda_graph_backend.BaseCudaGraphBackend",
    "sglang.srt.plugins.hook_registry.HookRegistry",
    CAPTURE_VAR,
)


def _check(target: str) -> str | None:
    """``None`` when ``target`` resolves, else why not.

    ``pkgutil.resolve_name`` reports a module that fails to import (a missing dependency such
    as torchvision) as a missing attribute of its parent; name the import error instead.
    """
    try:
        pkgutil.resolve_name(target)
    except Exception as exc:  # noqa: BLE001 - any failure to resolve is a finding, not a crash
        error: Exception = exc
    else:
        return None
    parts = target.split(".")
    for i in range(1, len(parts)):  # shortest prefix first: the first that fails is the culprit
        module = ".".join(parts[:i])
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name == module:
                break  # not a module (a class attribute, or it moved): the lookup error says it
            return f"cannot import {module}: {exc}"
        except Exception as exc:  # noqa: BLE001 - reported, the check continues
            return f"cannot import {module}: {type(exc).__name__}: {exc}"
    return f"{type(error).__name__}: {error}"


def _sglang_version() -> str | None:
    """The installed SGLang's version; ``None`` without an importable, installed ``sglang``.

    Both are required: a stray ``sglang`` directory (a namespace package) is not SGLang.
    """
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        return None
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def _entry_point() -> str | None:
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.value.replace(" ", "") == ENTRY_POINT_VALUE:
            dist = ep.dist.name if ep.dist is not None else "?"
            return f"{ep.name} = {ep.value} (dist {dist})"
    return None


def _flag() -> str:
    """The output mode a capture session would resolve now, and why (env var or SGLang's default)."""
    from .sglang_session import resolve_mode

    try:
        resolution = resolve_mode(None)
    except ValueError as exc:
        return f"invalid ({exc})"
    return f"{resolution.describe()}; --enable-bcg-shared-output overrides it at launch"


def doctor_main(argv: list[str] | None = None, *, out: TextIO | None = None) -> int:
    """Run the checks, print a report and return the exit code (0 ok, 1 missing, 2 no SGLang)."""
    parser = argparse.ArgumentParser(prog="sglang-bcg doctor", description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    stream = out if out is not None else sys.stdout

    def say(line: str) -> None:
        print(line, file=stream)

    version = _sglang_version()
    if version is None:
        say("SGLang not installed: pip install 'sglang-bcg-plugin[sglang]' into the serving environment")
        return 2
    supported = "supported" if version in SUPPORTED_SGLANG else f"untested; supported: {', '.join(SUPPORTED_SGLANG)}"
    say(f"SGLang {version} ({supported})")
    missing = 0
    say("hook targets:")
    for target, _, kind in HOOKS:
        problem = _check(target)
        missing += problem is not None
        say(f"  [{'ok' if problem is None else 'MISSING'}] {kind:<6} {target}" + (f"  ({problem})" if problem else ""))
    say("seam names:")
    for name in SEAM_NAMES:
        problem = _check(name)
        missing += problem is not None
        say(f"  [{'ok' if problem is None else 'MISSING'}] {name}" + (f"  ({problem})" if problem else ""))
    ep = _entry_point()
    say(f"entry point ({ENTRY_POINT_GROUP}): " + (ep or f"NOT FOUND (expected {ENTRY_POINT_VALUE})"))
    say(f"--enable-bcg-shared-output (resolved now): {_flag()}")
    if missing or ep is None:
        say(f"doctor: {missing} missing target(s){'' if ep else ', entry point not discoverable'}")
        return 1
    say("doctor: ok")
    return 0
