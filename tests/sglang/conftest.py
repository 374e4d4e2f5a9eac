"""SGLang-dependent tests: skipped without SGLang, unless ``SGLANG_BCG_REQUIRE_SGLANG=1`` (CI).

With that variable set, a missing or unimportable SGLang fails every ``sglang``-marked test
loudly instead of skipping it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import json
import os
import sys
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

#: Warnings importing SGLang emits on a CPU-only machine with torch 2.13 (quantization backends,
#: Triton on CPU, torch.jit deprecation in its dependencies, SWIG types in sentencepiece); the
#: subprocess tests filter these.
SGLANG_IMPORT_WARNINGS = (
    r"Only CUDA, (HIP and XPU support AWQ|MUSA and NPU support GGUF)"
    r"|`torch\.jit\.script_method` is deprecated"
    r"|builtin type Swig\w+ has no __module__ attribute"
    r"|Triton is not supported on current platform"
)
#: Every SGLang module the tests import (imported once, warnings filtered, before any test), per
#: seam of the installed release (``sglang_bcg_plugin.sglang.compat.seam_kind``).
SGLANG_MODULES = (
    "sglang.srt.plugins",
    "sglang.srt.plugins.hook_registry",
    "sglang.srt.server_args",
    "sglang.srt.layers.logits_processor",
    "sglang.srt.model_executor.forward_batch_info",
)
SEAM_MODULES = {
    "backend": (
        "sglang.srt.model_executor.runner_backend.utils",
        "sglang.srt.model_executor.runner_backend.breakable_cuda_graph_backend",
        "sglang.srt.model_executor.runner.shape_key",
        "sglang.srt.model_executor.runner.prefill_cuda_graph_runner",
    ),
    "runner": ("sglang.srt.model_executor.breakable_cuda_graph_runner",),
    "none": (),
}


@functools.cache
def sglang_problem() -> str | None:
    """Why SGLang cannot be used here, or ``None`` when it imports."""
    try:
        importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return "SGLang is not installed"
    sys.path.insert(0, str(HERE))
    import torchvision_standin

    torchvision_standin.install()
    try:
        with warnings.catch_warnings():
            # Import-time warnings of SGLang and its dependencies differ per release (quantization
            # backends and Triton on CPU, deprecations): none of them is ours.
            warnings.simplefilter("ignore")
            from sglang_bcg_plugin.sglang.compat import seam_kind

            for name in (*SGLANG_MODULES, *SEAM_MODULES[seam_kind()]):
                importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - reported as the skip/fail reason
        return f"SGLang does not import: {type(exc).__name__}: {exc}"
    return None


@pytest.fixture(autouse=True)
def _require_sglang(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("sglang") is None:
        return
    problem = sglang_problem()
    if problem is None:
        return
    if os.environ.get("SGLANG_BCG_REQUIRE_SGLANG") == "1":
        pytest.fail(f"SGLANG_BCG_REQUIRE_SGLANG=1 but {problem}", pytrace=False)
    pytest.skip(problem)


def declared_entry_point() -> str:
    """Our ``sglang.srt.plugins`` entry point as ``pyproject.toml`` declares it."""
    import tomllib

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (name, value), = data["project"]["entry-points"]["sglang.srt.plugins"].items()
    return f"{name} = {value}"


@pytest.fixture
def dist_dir(tmp_path: Path) -> Path:
    """A ``*.dist-info`` carrying our declared entry point; first on ``sys.path`` it shadows the
    installed metadata, so plugin discovery is tested against ``pyproject.toml`` itself."""
    info = tmp_path / "site" / "sglang_bcg_plugin-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang-bcg-plugin\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(f"[sglang.srt.plugins]\n{declared_entry_point()}\n")
    return tmp_path / "site"


_FORK_SERVER: list[Any] = []  # the session's one fork server, started by the first run_child


@pytest.fixture(scope="session", autouse=True)
def _close_fork_server() -> Iterator[None]:
    yield
    while _FORK_SERVER:
        _FORK_SERVER.pop().close()


def run_child(code: str, dist: Path, *, timeout: float = 120) -> SimpleNamespace:
    """Run ``code`` in a fresh child (stand-in torchvision, our dist-info on ``sys.path``), forked
    from the session's fork server (``fork_server.py``: torch and SGLang imported once).

    The child prints one JSON line prefixed ``RESULT=``; it is returned parsed as ``.result``.
    """
    prelude = f"""
import sys, warnings, json
sys.path[:0] = [{str(dist)!r}, {str(HERE)!r}]
warnings.filterwarnings("ignore", message={SGLANG_IMPORT_WARNINGS!r})
import torchvision_standin
torchvision_standin.install()
def report(**kw):
    print("RESULT=" + json.dumps(kw), flush=True)
"""
    from fork_server import ForkServer

    env = {k: v for k, v in os.environ.items() if k != "SGLANG_ENABLE_BCG_SHARED_OUTPUT"}
    if not _FORK_SERVER:
        _FORK_SERVER.append(ForkServer(env, ROOT, dist.parent / "fork-server.log"))
    out, err = dist.parent / "child.out", dist.parent / "child.err"
    rc = _FORK_SERVER[0].run(prelude + textwrap.dedent(code), env, ROOT, out, err, timeout)
    stdout, stderr = out.read_text(), err.read_text()
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT=")]
    assert rc == 0 and lines, f"child failed (rc={rc}):\n{stdout}\n{stderr[-4000:]}"
    return SimpleNamespace(result=json.loads(lines[-1][len("RESULT="):]), stdout=stdout, stderr=stderr)


def seam() -> Any:
    """The installed release's seam, as the plugin probes it."""
    from sglang_bcg_plugin.sglang.compat import installed

    return installed()


@pytest.fixture
def backend_seam() -> None:
    """Skip unless the installed SGLang has the backend seam (0.5.14+)."""
    if sglang_problem() is None and seam().kind != "backend":
        pytest.skip(f"{seam().describe()}: these tests drive the backend seam")


@pytest.fixture
def runner_seam() -> None:
    """Skip unless the installed SGLang has the runner seam (0.5.13)."""
    if sglang_problem() is None and seam().kind != "runner":
        pytest.skip(f"{seam().describe()}: these tests drive the runner seam")


def bcg_module() -> Any:
    """The module of the installed release's segment engine (``eager_on_graph``, ``BreakableCUDAGraph``)."""
    from sglang_bcg_plugin.sglang.compat import BACKEND_MODULE, RUNNER_MODULE

    name = BACKEND_MODULE if seam().kind == "backend" else RUNNER_MODULE
    module = importlib.import_module(name)
    return sys.modules[module.BreakableCUDAGraphCapture.__module__]


def eager_break(fn: Any) -> Any:
    """``fn`` as an eager break point of SGLang's segment engine, in the installed form."""
    from sglang_bcg_plugin.sglang.compat import eager_break as wrap

    return wrap(bcg_module(), fn, seam().eager_form)


@contextlib.contextmanager
def tp_group_installed(group: object, *, permanently: bool = False) -> Iterator[None]:
    """Publish ``group`` as SGLang's TP group where the release reads it from ``get_parallel()``
    (0.5.22+; older releases read ``model_runner.tp_group``, which ``FakeRunner`` carries)."""
    try:
        from sglang.srt.runtime_context import get_parallel
    except ImportError:  # 0.5.13: no runtime context
        yield
        return
    parallel = get_parallel()
    if permanently and hasattr(parallel, "override_permanently"):
        parallel.override_permanently(tp_group=group)
        yield
    elif hasattr(parallel, "override"):
        with parallel.override(tp_group=group):
            yield
    else:  # pragma: no cover - a release without either form
        yield


@pytest.fixture
def cpu_bcg(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Swap only BCG's CUDA-graph primitives for the CPU stand-ins (see cpu_graph_standin)."""
    import torch

    from cpu_graph_standin import FakeGroup, SegmentGraph

    monkeypatch.setattr(torch.cuda, "CUDAGraph", SegmentGraph)
    # Releases up to 0.5.22 ask torch.cuda (0.5.23: the device module) for the current stream.
    monkeypatch.setattr(torch.cuda, "current_stream", torch.cpu.current_stream)
    # Releases up to 0.5.22 weak-ref every break argument, which raises on CPU; 0.5.23 keeps CPU
    # tensors as they are: the stand-in does what 0.5.23 does.
    engine = bcg_module()
    original = engine._weak_ref_if_tensor  # private: SGLang's helper, patched for CPU tensors
    monkeypatch.setattr(
        engine, "_weak_ref_if_tensor", lambda x: x if torch.is_tensor(x) and x.device.type == "cpu" else original(x)
    )
    with tp_group_installed(FakeGroup()):
        yield
