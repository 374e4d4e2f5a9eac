"""``sglang-bcg doctor``: is this SGLang install one our hooks fit?

Prints the installed SGLang version, whether every hook target (and each SGLang name our
breakable backend relies on) exists, whether our ``sglang.srt.plugins`` entry point is
discoverable, and the resolved sharing flag. Findings are grouped by cause: a seam that moved
(SGLang imports, the name is gone) is not a dependency SGLang itself is missing. Exit codes: 0
all good, 1 a seam moved or the entry point is missing, 2 SGLang is not installed, 3 SGLang is
installed but does not import (e.g. its dependency torchvision is missing). SGLang is imported
only inside :func:`doctor_main`.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import os
import pkgutil
import re
import sys
from collections import Counter
from dataclasses import dataclass
from collections.abc import Callable, Mapping
from typing import TextIO

from .compat import ENV_FORECAST
from .doctor_checks import seam_checks
from .forecast_log import forecast_enabled
from .compat import BACKEND_CLASS, RUNNER_CLASS, Seam, installed, one_line, seam_kind
from .hooks import hooks_for
from .switch import MODULES as SWITCH_MODULES
from .switch import doctor_line as switch_doctor_line

#: The SGLang releases this integration was checked against (the ``[sglang]`` extra allows them).
SUPPORTED_SGLANG = tuple(f"0.5.{n}" for n in range(13, 24))
ENTRY_POINT_GROUP = "sglang.srt.plugins"
ENTRY_POINT_VALUE = "sglang_bcg_plugin.integration:register"
#: How to install the plugin with a supported SGLang (the package is not on PyPI).
INSTALL = "from a checkout of sglang_bcg_plugin: pip install -e '.[sglang]'"
#: Dependencies built against one torch: installing one from PyPI may replace torch itself.
TORCH_BOUND = frozenset({"torchvision", "torchaudio", "sgl_kernel", "triton", "xformers", "flashinfer"})

#: Names every seam needs besides its own (``calls``).
COMMON_NAMES = ("sglang.srt.plugins.hook_registry.HookRegistry",)


@dataclass(frozen=True)
class Problem:
    """Why one name does not resolve.

    ``kind``: ``"moved"`` (its module imports, the name is not there: an SGLang upgrade moved a
    seam), ``"dependency"`` (an SGLang module needs a package that is not installed, named by
    ``dependency``) or ``"import"`` (an SGLang module raises something else on import).
    """

    kind: str
    detail: str
    dependency: str | None = None


#: How transformers words a missing optional dependency in an ``ImportError``.
_REQUIRES = re.compile(r"requires the (\w+) library but it was not found")


def _diagnose(target: str) -> Problem | None:
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
            detail = f"cannot import {module}: {exc}"
            missing = (exc.name or "").split(".")[0]
            if missing and missing != parts[0]:
                return Problem("dependency", detail, missing)
            return Problem("import", detail)
        except Exception as exc:  # noqa: BLE001 - reported, the check continues
            detail = f"cannot import {module}: {type(exc).__name__}: {one_line(exc)}"
            named = _REQUIRES.search(str(exc)) if isinstance(exc, ImportError) else None
            if named is not None:  # transformers' "requires the Torchvision library but it was not found"
                return Problem("dependency", detail, named.group(1).lower())
            return Problem("import", detail)
    return Problem("moved", f"{type(error).__name__}: {error}")


def _check(target: str) -> str | None:
    """``None`` when ``target`` resolves, else why not, in words."""
    problem = _diagnose(target)
    return None if problem is None else problem.detail


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
        resolution = resolve_mode()
    except ValueError as exc:
        return f"invalid ({exc})"
    return f"{resolution.describe()}; --enable-bcg-shared-output overrides it at launch"


#: Exit codes of ``sglang-bcg doctor`` (docs/sglang.md).
EXIT_OK, EXIT_MOVED, EXIT_NO_SGLANG, EXIT_IMPORT = 0, 1, 2, 3


def _summary(problems: list[Problem], entry_point_found: bool) -> tuple[list[str], int]:
    """The closing lines, grouped by cause, and the exit code (moved seams outrank the rest)."""
    lines, code = [], EXIT_OK
    moved = sum(p.kind == "moved" for p in problems)
    if moved:
        lines.append(f"doctor: {moved} seam(s) moved: this SGLang does not fit the plugin; do not serve with it")
        code = EXIT_MOVED
    if not entry_point_found:
        lines.append(f"doctor: entry point not discoverable: reinstall the plugin into this environment ({INSTALL})")
        code = EXIT_MOVED
    for dep, n in Counter(p.dependency for p in problems if p.kind == "dependency").items():
        lines.append(f"doctor: SGLang could not be imported: dependency {dep!r} is missing ({_advice(dep)}); {n} name(s) could not be checked")
        code = code or EXIT_IMPORT
    for p in problems:
        if p.kind == "import":
            lines.append(f"doctor: SGLang could not be imported: {p.detail}")
            code = code or EXIT_IMPORT
            break
    return lines or ["doctor: ok"], code


#: PyTorch's own index of CPU builds (``+cpu``: torch and the torchvision made for it).
CPU_WHEELS = "https://download.pytorch.org/whl/cpu"


def torchvision_for(torch_version: str) -> str | None:
    """The torchvision release made for ``torch_version`` (torch 2.N: torchvision 0.(N+15); the
    wheel of 0.28.0 requires ``torch==2.13.0``); ``None`` outside torch 2."""
    match = re.match(r"2\.(\d+)(\.|$)", torch_version)
    return None if match is None else f"0.{int(match.group(1)) + 15}"


def _advice(dep: str | None) -> str:
    if dep not in TORCH_BOUND:
        return "install it into this environment: SGLang imports it"
    import torch

    pair = torchvision_for(torch.__version__) if dep == "torchvision" else None
    if pair is None:
        return (
            f"install the {dep} build made for the installed torch {torch.__version__} into this environment, "
            f"keeping that torch (a {dep} built for another torch makes pip replace torch)"
        )
    base = torch.__version__.split("+")[0]
    if torch.__version__.endswith("+cpu"):
        # Checked with torch 2.13.0+cpu: PyPI's torchvision 0.28.0 (built for PyPI's torch, a CUDA
        # build on Linux) fails to import ("operator torchvision::nms does not exist").
        return (
            f"torch {torch.__version__} is a CPU build from PyTorch's own wheels, and PyPI's torchvision is built "
            f"for PyPI's torch and does not load with it: install the CPU build of torchvision {pair} (the release "
            f"made for torch {base}), pip install 'torchvision=={pair}.*' --index-url {CPU_WHEELS}; the plugin "
            "itself does not import torchvision, SGLang's modules do"
        )
    return (
        f"install torchvision {pair} (the release made for torch {base}) into this environment, pip install "
        f"'torchvision=={pair}.*', keeping that torch (a torchvision built for another torch makes pip replace torch)"
    )


def _seam_lines(say: Callable[[str], None], problems: list[Problem]) -> Seam | None:
    """Probe the seam and print each call our capture makes; ``None`` when it cannot be probed."""
    try:
        seam = installed()
    except Exception as exc:  # noqa: BLE001 - reported: the probe imports SGLang
        problems.append(Problem("import", f"probing the breakable graph: {type(exc).__name__}: {exc}"))
        say(f"  [NOT CHECKED] the breakable graph ({type(exc).__name__}: {exc})")
        return None
    say(f"seam: {seam.describe()}")
    if seam.kind == "none":
        problems.append(Problem("moved", seam.why))
        return seam
    say("what the capture calls:")
    for label, check in seam_checks(seam):
        try:
            why = check()
        except Exception as exc:  # noqa: BLE001 - a check that cannot run is a failed check
            why = f"{type(exc).__name__}: {exc}"
        if why is None:
            say(f"  [ok] {label}")
        else:
            problems.append(Problem("moved", f"{label}: {why}"))
            say(f"  [MISSING] {label}  ({why})")
    say("features: " + ", ".join(f"{name}={value!r}" for name, value in seam.features().items()))
    return seam


def forecast_line(kind: str | None, environ: Mapping[str, str] | None = None) -> str:
    """How to read the forecast lines in SGLang's log (docs/sglang.md), or why there are none."""
    env = os.environ if environ is None else environ
    try:
        enabled = forecast_enabled(env)
    except ValueError as exc:
        return f"invalid ({exc})"
    if not enabled:
        return (f"off ({ENV_FORECAST}={env.get(ENV_FORECAST, '')!r}); {ENV_FORECAST}=1 logs, after each capture "
                "session's first graph, the schedule's graph memory per output mode (docs/sglang.md)")
    if kind != "backend":
        return "not on this release's seam (the runner seam of 0.5.13 logs none)"
    return ("on: after each capture session's first (largest) graph, one INFO line 'sglang_bcg: graph memory "
            "forecast for N sizes up to M: X MiB with --enable-bcg-shared-output=MODE' says what free device "
            "memory the whole schedule will take (graph pool, capture stream, the CUDA driver's share) and what "
            "that frees against the other modes (MiB, and KV-cache tokens at the KV pool's bytes per token); "
            "after the session 'graph memory after capture' gives what the graph pool grew by beside the pool's "
            "forecast, and the free device memory the session lost beside the whole. Needs CUDA")


def doctor_main(argv: list[str] | None = None, *, out: TextIO | None = None) -> int:
    """Run the checks, print a report and return the exit code.

    0 ok; 1 a seam moved or the entry point is missing; 2 SGLang is not installed; 3 SGLang is
    installed but some of its modules do not import (a missing dependency such as torchvision).
    """
    parser = argparse.ArgumentParser(prog="sglang-bcg doctor", description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    stream = out if out is not None else sys.stdout

    def say(line: str) -> None:
        print(line, file=stream)

    version = _sglang_version()
    if version is None:
        say(f"SGLang not installed: install it into the serving environment ({INSTALL})")
        return EXIT_NO_SGLANG
    supported = "supported" if version in SUPPORTED_SGLANG else f"untested; supported: {SUPPORTED_SGLANG[0]} to {SUPPORTED_SGLANG[-1]}"
    say(f"SGLang {version} ({supported})")
    problems: list[Problem] = []

    def report(prefix: str, name: str) -> None:
        problem = _diagnose(name)
        if problem is None:
            say(f"  [ok] {prefix}{name}")
            return
        problems.append(problem)
        tag = {"moved": "MISSING", "dependency": "NOT CHECKED", "import": "NOT CHECKED"}[problem.kind]
        say(f"  [{tag}] {prefix}{name}  ({problem.detail})")

    kind = seam_kind()
    say("hook targets:")
    for target, _, hook_kind in hooks_for(kind):
        if target not in SWITCH_MODULES:  # read from source below: the HTTP server's module needs FastAPI
            report(f"{hook_kind:<6} ", target)
    say("seam names:")
    for name in (*COMMON_NAMES, *({"backend": (BACKEND_CLASS,), "runner": (RUNNER_CLASS,)}.get(kind, ()))):
        report("", name)
    if not problems:  # the names import: probe what the capture calls
        _seam_lines(say, problems)
    ep = _entry_point()
    say(f"entry point ({ENTRY_POINT_GROUP}): " + (ep or f"NOT FOUND (expected {ENTRY_POINT_VALUE})"))
    say(f"--enable-bcg-shared-output (resolved now): {_flag()}")
    say(f"graph memory forecast: {forecast_line(kind)}")
    say(f"live switch: {switch_doctor_line(kind)}")
    lines, code = _summary(problems, ep is not None)
    for line in lines:
        say(line)
    return code
