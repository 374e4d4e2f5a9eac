"""``sglang-bcg doctor``: is this SGLang install one our hooks fit?
Exit codes: 0 all good, 1 a seam moved or no entry point, 2 no SGLang, 3 SGLang does not import."""

from __future__ import annotations

import ast
import argparse
import functools
import importlib.metadata
import importlib.util
import inspect
import os
import pkgutil
import re
import sys
import warnings
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import TextIO

import torch

from .._constants import NAME
from .._version import package_version
from ..errors import BackendRegistrationError, PluginLoadWarning, one_line
from ..registry import build_registry, listing
from .compat import (BACKEND_CLASS, BACKEND_MODULE, ENV_FORECAST, RUNNER_CLASS, RUNNER_MODULE, Seam, code_names,
                     installed, seam_kind, sglang_source)
from .forecast_log import forecast_enabled
from .hooks import has_post_capture_sizing
from .incremental import (CAN_RUN_TARGET, CAPTURE_TARGET, ENV_INCREMENTAL, START_TARGET, STEP_TARGET,
                          has_runner_seam, incremental_enabled)
from .memory_plan import ENV_PLAN, RESIZE_TARGET, check_environment, plan_enabled
from .hooks import hooks_for
from .sglang_breakable import BASE_MODULE, unknown_capture_helpers
from .sglang_session import resolve_mode
from .switch.routes import HTTP_TARGET, ROUTE
from .switch.rpc import RPC_TARGET

#: The hooks of opt-in features: not checked as targets (each feature's line says whether it applies).
OPT_IN_TARGETS = frozenset({RESIZE_TARGET, START_TARGET, CAPTURE_TARGET, CAN_RUN_TARGET, STEP_TARGET})
#: The SGLang releases this integration was checked against.
SUPPORTED_SGLANG = tuple(f"0.5.{n}" for n in range(13, 24))
ENTRY_POINT_GROUP = "sglang.srt.plugins"
#: Each live-switch target and the module that holds it.
SWITCH_MODULES = {HTTP_TARGET: "sglang.srt.entrypoints.http_server", RPC_TARGET: "sglang.srt.managers.scheduler"}
ENTRY_POINT_VALUE = "sglang_bcg_plugin.sglang:register"
INSTALL = "from a checkout of sglang_bcg_plugin: pip install -e '.[sglang]'"
#: Dependencies built against one torch: installing one from PyPI may replace torch itself.
TORCH_BOUND = frozenset({"torchvision", "torchaudio", "sgl_kernel", "triton", "xformers", "flashinfer"})
COMMON_NAMES = ("sglang.srt.plugins.hook_registry.HookRegistry",)  #: every seam needs it
#: How transformers words a missing optional dependency in an ``ImportError``.
_REQUIRES = re.compile(r"requires the (\w+) library but it was not found")
EXIT_OK, EXIT_MOVED, EXIT_NO_SGLANG, EXIT_IMPORT = 0, 1, 2, 3
#: PyTorch's own index of CPU builds (``+cpu``: torch and the torchvision made for it).
CPU_WHEELS = "https://download.pytorch.org/whl/cpu"
#: Attributes SGLang's ``BreakableCudaGraphBackend.__init__`` must set (our capture reads them).
BACKEND_ATTRS = ("_graphs", "_outputs", "_pool", "_debug_eager")


@dataclass(frozen=True)
class Problem:
    """Why one name does not resolve: ``"moved"`` (its module imports, the name is not there),
    ``"dependency"`` (a package SGLang imports is missing: ``dependency``) or ``"import"``."""

    kind: str
    detail: str
    dependency: str | None = None


def defined_in_source(target: str, module: str) -> bool:
    """Whether ``module``'s source defines ``target`` (``module.func`` or ``module.Class.method``),
    read with ``ast``, without importing it (the HTTP server's module needs FastAPI)."""
    path = sglang_source(module)
    body: list[ast.stmt] | None = [] if path is None else ast.parse(path.read_text(encoding="utf-8")).body
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    for part in target[len(module) + 1:].split("."):
        body = next((n.body for n in body or () if isinstance(n, kinds) and n.name == part), None)
        if body is None:
            return False
    return True


def switch_doctor_line(seam_kind: str) -> str:
    """``sglang-bcg doctor``'s one line on the live switch."""
    missing = [t for t, m in SWITCH_MODULES.items() if not defined_in_source(t, m)]
    if seam_kind not in ("backend", "runner"):
        return "not available (no breakable CUDA graph to switch)"
    if missing:
        return f"not available on this release: {', '.join(missing)} not found"
    how = ("on this release a POST is refused (its runner cannot drop its graphs)" if seam_kind == "runner"
           else "sglang-bcg switch --url URL --api-key KEY off|on|released")
    return (f"GET/POST {ROUTE} registered only when the server starts with --admin-api-key (SGLang's admin "
            f"authentication); without it the route does not exist; {how}")


def _diagnose(target: str) -> Problem | None:
    """``None`` when ``target`` resolves, else why not (the import error of a module that does
    not import, which ``pkgutil.resolve_name`` reports as a missing attribute)."""
    try:
        pkgutil.resolve_name(target)
        return None
    except Exception as exc:  # noqa: BLE001 - any failure to resolve is a finding, not a crash
        error: Exception = exc
    parts = target.split(".")
    for i in range(1, len(parts)):  # shortest prefix first: the first that fails is the culprit
        module = ".".join(parts[:i])
        try:
            importlib.import_module(module)
            continue
        except ModuleNotFoundError as exc:
            if exc.name == module:
                break  # not a module (a class attribute, or it moved): the lookup error says it
            missing = (exc.name or "").split(".")[0]
            detail, dep = f"cannot import {module}: {exc}", missing if missing not in ("", parts[0]) else None
        except Exception as exc:  # noqa: BLE001 - reported, the check continues
            detail = f"cannot import {module}: {type(exc).__name__}: {one_line(exc)}"
            named = _REQUIRES.search(str(exc)) if isinstance(exc, ImportError) else None
            dep = None if named is None else named.group(1).lower()
        return Problem("import" if dep is None else "dependency", detail, dep)
    return Problem("moved", f"{type(error).__name__}: {error}")


def _sglang_version() -> str | None:
    """The installed SGLang's version; ``None`` without one (a namespace package is not SGLang)."""
    spec = importlib.util.find_spec("sglang")
    return (package_version("sglang", "") or None) if spec is not None and spec.origin is not None else None


def _entry_point() -> str | None:
    return next((f"{ep.name} = {ep.value} (dist {ep.dist.name if ep.dist is not None else '?'})"
                 for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
                 if ep.value.replace(" ", "") == ENTRY_POINT_VALUE), None)


def _summary(problems: list[Problem], entry_point_found: bool) -> tuple[list[str], int]:
    """The closing lines, grouped by cause, and the exit code (moved seams outrank the rest)."""
    moved = sum(p.kind == "moved" for p in problems)
    lines: list[str] = []
    if moved:
        lines.append(f"doctor: {moved} seam(s) moved: this SGLang does not fit the plugin; do not serve with it")
    if not entry_point_found:
        lines.append(f"doctor: entry point not discoverable: reinstall the plugin into this environment ({INSTALL})")
    for dep, n in Counter(p.dependency for p in problems if p.kind == "dependency").items():
        lines.append(f"doctor: SGLang could not be imported: dependency {dep!r} is missing ({_advice(dep)}); "
                     f"{n} name(s) could not be checked")
    lines += [f"doctor: SGLang could not be imported: {p.detail}" for p in problems if p.kind == "import"][:1]
    code = EXIT_MOVED if moved or not entry_point_found else EXIT_IMPORT if lines else EXIT_OK
    return lines or ["doctor: ok"], code


def torchvision_for(torch_version: str) -> str | None:
    """The torchvision release made for ``torch_version`` (torch 2.N: 0.(N+15)); ``None`` outside torch 2."""
    match = re.match(r"2\.(\d+)(\.|$)", torch_version)
    return None if match is None else f"0.{int(match.group(1)) + 15}"


def _advice(dep: str | None) -> str:
    if dep not in TORCH_BOUND:
        return "install it into this environment: SGLang imports it"
    keep = f"keeping that torch (a {dep} built for another torch makes pip replace torch)"
    pair = torchvision_for(torch.__version__) if dep == "torchvision" else None
    if pair is None:
        return f"install the {dep} build made for the installed torch {torch.__version__} into this environment, {keep}"
    made = f"torchvision {pair} (the release made for torch {torch.__version__.split('+')[0]})"
    if torch.__version__.endswith("+cpu"):
        return (f"torch {torch.__version__} is a CPU build from PyTorch's own wheels, and PyPI's torchvision is built "
                f"for PyPI's torch and does not load with it: install the CPU build of {made}, pip install "
                f"'torchvision=={pair}.*' --index-url {CPU_WHEELS}; the plugin itself does not import torchvision, "
                "SGLang's modules do")
    return f"install {made} into this environment, pip install 'torchvision=={pair}.*', {keep}"


def _lacks(how: str, dotted: str, *names: str) -> str | None:
    """Why ``dotted`` fails a check (``None``: it holds): ``params``, ``source`` or ``uses`` (each of ``names``
    among its parameters, in its source, among its code's names), ``attrs``, ``capture_var`` or ``helpers``."""
    obj = pkgutil.resolve_name(dotted)
    if how == "capture_var":
        module = sys.modules[obj.__module__]
        return None if hasattr(module, "_current_capture_var") else f"{module.__name__} has no _current_capture_var"
    if how == "helpers":
        unknown = unknown_capture_helpers(obj)
        return f"uses {unknown}, unknown to sglang_bcg" if unknown else None
    if how == "attrs":
        return next((f"no {n}" for n in names if not hasattr(obj, n)), None)
    if how == "source":
        try:
            have: Collection[str] = inspect.getsource(obj)
        except (OSError, TypeError) as exc:
            return f"cannot read the source ({type(exc).__name__})"
    else:
        have = list(inspect.signature(obj).parameters) if how == "params" else code_names(obj) or frozenset()
    missing = [n for n in names if n not in have]
    if missing and how == "params":
        return f"parameters {missing} missing from ({', '.join(have)})"
    return f"does not {'contain' if how == 'source' else 'use'} {missing}" if missing else None


def seam_checks(seam: Seam) -> list[tuple[str, Callable[[], str | None]]]:
    """What our capture calls or reads on ``seam``, one ``(label, check)`` each (``check()`` says why it fails,
    ``None``: it holds); none without a seam (doctor says so itself)."""
    p = functools.partial(functools.partial, _lacks)
    if seam.kind == "backend":
        cls, mod = f"{BACKEND_MODULE}:BreakableCudaGraphBackend", f"{BACKEND_MODULE}:"
        inputs = "capture_inputs" if seam.capture_inputs else "dummies"
        return [
            (f"{BACKEND_CLASS}.__init__(cuda_graph_runner, *, enable_memory_saver, debug_eager)",
             p("params", f"{cls}.__init__", "cuda_graph_runner", "enable_memory_saver", "debug_eager")),
            (f"{BACKEND_CLASS}.__init__ sets {', '.join(BACKEND_ATTRS)}", p("uses", f"{cls}.__init__", *BACKEND_ATTRS)),
            (f"{BACKEND_CLASS}.capture_session / replay / cleanup",
             p("attrs", cls, "capture_session", "replay", "cleanup")),
            (f"{BACKEND_CLASS}.capture_one(shape_key, forward_fn, {inputs}, post_warmup_hook)",
             p("params", f"{cls}.capture_one", "shape_key", "forward_fn", inputs, "post_warmup_hook")),
            (f"{BACKEND_CLASS}.capture_one keeps outputs only through the helpers sglang_bcg overrides",
             p("helpers", f"{cls}.capture_one")),
            (f"{BACKEND_MODULE}.BreakableCUDAGraphCapture(cuda_graph, pool, stream)",
             p("params", f"{mod}BreakableCUDAGraphCapture.__init__", "cuda_graph", "pool", "stream")),
            (f"{BACKEND_MODULE}.BreakableCUDAGraph's module: _current_capture_var",
             p("capture_var", f"{mod}BreakableCUDAGraph")),
            (f"{BASE_MODULE}.BaseCudaGraphBackend", p("attrs", f"{BASE_MODULE}:BaseCudaGraphBackend")),
        ]
    if seam.kind != "runner":
        return []
    cls = f"{RUNNER_MODULE}:BreakableCudaGraphRunner"
    return [
        (f"{RUNNER_CLASS}._capture_one(num_tokens, pool, stream)",
         p("params", f"{cls}._capture_one", "num_tokens", "pool", "stream")),
        (f"{RUNNER_CLASS}._capture_one runs self._run_forward inside BreakableCUDAGraphCapture",
         p("source", f"{cls}._capture_one", "self._run_forward(", "BreakableCUDAGraphCapture(")),
        (f"{RUNNER_CLASS}._capture_all stores output_buffers[num_tokens] from _capture_one",
         p("source", f"{cls}._capture_all", "self._capture_one(", "self.output_buffers[num_tokens] = output")),
        (f"{RUNNER_CLASS}.replay returns output_buffers[static_num_tokens]",
         p("source", f"{cls}.replay", "self.output_buffers[static_num_tokens]")),
        (f"{RUNNER_MODULE}.BreakableCUDAGraphCapture's module: _current_capture_var",
         p("capture_var", f"{RUNNER_MODULE}:BreakableCUDAGraphCapture")),
    ]


def _report(say: Callable[[str], None], problems: list[Problem], label: str, problem: Problem | None) -> None:
    if problem is None:
        say(f"  [ok] {label}")
    else:
        problems.append(problem)
        say(f"  [{'MISSING' if problem.kind == 'moved' else 'NOT CHECKED'}] {label}  ({problem.detail})")


def _seam_lines(say: Callable[[str], None], problems: list[Problem]) -> None:
    """Probe the seam and print each call our capture makes."""
    try:
        seam = installed()
    except Exception as exc:  # noqa: BLE001 - reported: the probe imports SGLang
        problems.append(Problem("import", f"probing the breakable graph: {type(exc).__name__}: {exc}"))
        say(f"  [NOT CHECKED] the breakable graph ({type(exc).__name__}: {exc})")
        return
    say(f"seam: {seam.describe()}")
    if seam.kind == "none":
        problems.append(Problem("moved", seam.why))
        return
    say("what the capture calls:")
    for label, check in seam_checks(seam):
        try:
            why = check()
        except Exception as exc:  # noqa: BLE001 - a check that cannot run is a failed check
            why = f"{type(exc).__name__}: {exc}"
        _report(say, problems, label, None if why is None else Problem("moved", why))
    say("features: " + ", ".join(f"{name}={value!r}" for name, value in seam.features().items()))


def backend_lines() -> tuple[list[str], str | None]:
    """The registered backends a phase can be routed to, one line each as ``sglang-bcg backends`` prints them,
    and the summary line when a plugin is broken or the registry refuses a registration (the exit code stays)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PluginLoadWarning)  # printed as BROKEN lines
        try:
            registry = build_registry()
        except BackendRegistrationError as exc:
            return [f"  [REFUSED] {' '.join(str(exc).split())}"], (
                f"doctor: the {NAME} backend registry refuses a registration: no backend can be selected "
                "(see the REFUSED line)")
    return [f"  {line}" for line in listing(registry)], None if not registry.broken else (
        f"doctor: {len(registry.broken)} {NAME} plugin(s) broken: their backends cannot be selected, the others work "
        "(see the BROKEN lines)")


def _feature_line(env: Mapping[str, str], var: str, enabled: Callable[[Mapping[str, str]], bool], what: str,
                  applies: Callable[[], bool], not_applied: str, on: str) -> str:
    """One opt-in feature's line: ``invalid``, ``off`` (and what ``var=1`` does), not applied here, or ``on``."""
    try:
        if not enabled(env):
            return f"off ({var}={env.get(var, '')!r}); {var}=1 {what}"
    except ValueError as exc:
        return f"invalid ({exc})"
    return on if applies() else not_applied


def forecast_line(kind: str | None, environ: Mapping[str, str] | None = None) -> str:
    """How to read the forecast lines in SGLang's log (docs/sglang.md), or why there are none."""
    return _feature_line(
        os.environ if environ is None else environ, ENV_FORECAST, forecast_enabled,
        "logs, after each capture session's first graph, the schedule's graph memory per output mode (docs/sglang.md)",
        lambda: kind == "backend", "not on this release's seam (the runner seam of 0.5.13 logs none)",
        "on: after each capture session's first (largest) graph, one INFO line 'sglang_bcg: graph memory forecast "
        "for N sizes up to M: X MiB with --enable-bcg-shared-output=MODE' says what free device memory the whole "
        "schedule will take (graph pool, capture stream, the CUDA driver's share) and what that frees against the "
        "other modes (MiB, and KV-cache tokens at the KV pool's bytes per token); after the session 'graph memory "
        "after capture' gives what the graph pool grew by beside the pool's forecast, and the free device memory "
        "the session lost beside the whole. Needs CUDA")


def plan_line(kind: str | None, environ: Mapping[str, str] | None = None) -> str:
    """Whether the memory plan is asked and can size this release's KV pool (docs/sglang.md#the-memory-plan)."""
    def enabled(env: Mapping[str, str]) -> bool:
        check_environment(env)
        return plan_enabled(env)

    return _feature_line(
        os.environ if environ is None else environ, ENV_PLAN, enabled,
        "backs the KV pool after capture with all the memory but the measured eager working set and a margin "
        "(docs/sglang.md#the-memory-plan)",
        lambda: kind == "backend" and has_post_capture_sizing(),
        "asked, but this release allocates the KV pool before capture (0.5.16+ can back it after): not applied",
        "on: after capture, 'sglang_bcg: memory plan: card ...' gives the parts and the KV pool, then 'KV backed N "
        "tokens ...' what was taken; MLA models and --enable-memory-saver keep SGLang's own sizing")


def incremental_line(kind: str | None, environ: Mapping[str, str] | None = None) -> str:
    """Whether the incremental capture is asked and can run on this release (docs/sglang.md#incremental-capture)."""
    return _feature_line(
        os.environ if environ is None else environ, ENV_INCREMENTAL, incremental_enabled,
        "captures the largest prefill size before serving and the others between batches "
        "(docs/sglang.md#incremental-capture)",
        lambda: kind == "backend" and has_runner_seam(),
        "asked, but this release's prefill runner has not the capture pass it hooks (0.5.14+ has): not applied",
        "on: 'sglang_bcg: incremental capture: ...' in the log at start-up, every ten sizes and when every size is "
        "captured; GET /bcg/output_mode shows each rank's progress ('incremental')")


def doctor_main(argv: list[str] | None = None, *, out: TextIO | None = None) -> int:
    """Run the checks, print a report and return the exit code (the module's doc lists them)."""
    argparse.ArgumentParser(prog="sglang-bcg doctor", description=__doc__.splitlines()[0]).parse_args(argv)
    say = functools.partial(print, file=out or sys.stdout)
    if (version := _sglang_version()) is None:
        say(f"SGLang not installed: install it into the serving environment ({INSTALL})")
        return EXIT_NO_SGLANG
    supported = ("supported" if version in SUPPORTED_SGLANG
                 else f"untested; supported: {SUPPORTED_SGLANG[0]} to {SUPPORTED_SGLANG[-1]}")
    say(f"SGLang {version} ({supported})")
    problems: list[Problem] = []
    kind = seam_kind()
    say("hook targets:")
    for target, _, hook_kind in hooks_for(kind):
        if target in OPT_IN_TARGETS:
            continue  # registered only where asked and where the release has them: their own lines below
        if target not in SWITCH_MODULES:  # read from source below: the HTTP server's module needs FastAPI
            _report(say, problems, f"{hook_kind:<6} {target}", _diagnose(target))
    say("seam names:")
    for name in (*COMMON_NAMES, *({"backend": (BACKEND_CLASS,), "runner": (RUNNER_CLASS,)}.get(kind, ()))):
        _report(say, problems, name, _diagnose(name))
    if not problems:  # the names import: probe what the capture calls
        _seam_lines(say, problems)
    ep = _entry_point()
    say(f"entry point ({ENTRY_POINT_GROUP}): " + (ep or f"NOT FOUND (expected {ENTRY_POINT_VALUE})"))
    backends, backend_problem = backend_lines()
    say(f"backends ({NAME} plugins):", *backends, sep="\n")
    try:  # the mode a capture session would resolve now, and why
        flag = f"{resolve_mode().describe()}; --enable-bcg-shared-output overrides it at launch"
    except ValueError as exc:
        flag = f"invalid ({exc})"
    say(f"--enable-bcg-shared-output (resolved now): {flag}")
    say(f"graph memory forecast: {forecast_line(kind)}")
    say(f"memory plan: {plan_line(kind)}")
    say(f"incremental capture: {incremental_line(kind)}")
    say(f"live switch: {switch_doctor_line(kind)}")
    lines, code = _summary(problems, ep is not None)  # a broken plugin leaves the seam and the exit code as they are
    say("\n".join([backend_problem, *lines] if backend_problem is not None else lines))
    return code
