"""SGLang-dependent tests: skipped without SGLang, unless ``SGLANG_BCG_REQUIRE_SGLANG=1`` (CI).

With that variable set, a missing or unimportable SGLang fails every ``sglang``-marked test
loudly instead of skipping it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

#: Warnings importing SGLang 0.5.23 emits on a CPU-only machine with torch 2.13 (quantization
#: backends, torch.jit deprecation in its dependencies, SWIG types in sentencepiece).
SGLANG_IMPORT_WARNINGS = (
    r"Only CUDA, (HIP and XPU support AWQ|MUSA and NPU support GGUF)"
    r"|`torch\.jit\.script_method` is deprecated"
    r"|builtin type Swig\w+ has no __module__ attribute"
)
#: Every SGLang module the tests import (imported once, warnings filtered, before any test).
SGLANG_MODULES = (
    "sglang.srt.plugins",
    "sglang.srt.plugins.hook_registry",
    "sglang.srt.server_args",
    "sglang.srt.runtime_context",
    "sglang.srt.model_executor.runner_backend.utils",
    "sglang.srt.model_executor.runner_backend.breakable_cuda_graph_backend",
    "sglang.srt.model_executor.runner.shape_key",
    "sglang.srt.model_executor.runner.prefill_cuda_graph_runner",
    "sglang.srt.layers.logits_processor",
)


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
            warnings.filterwarnings("ignore", message=SGLANG_IMPORT_WARNINGS)
            for name in SGLANG_MODULES:
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


def run_child(code: str, dist: Path, *, env: dict[str, str] | None = None, timeout: float = 120) -> SimpleNamespace:
    """Run ``code`` in a fresh interpreter (stand-in torchvision, our dist-info on ``sys.path``).

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
    full_env = {k: v for k, v in os.environ.items() if k != "SGLANG_ENABLE_BCG_SHARED_OUTPUT"}
    full_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        capture_output=True, text=True, timeout=timeout, env=full_env, cwd=str(ROOT), check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT=")]
    assert proc.returncode == 0 and lines, f"child failed (rc={proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return SimpleNamespace(result=json.loads(lines[-1][len("RESULT="):]), stdout=proc.stdout, stderr=proc.stderr)


@pytest.fixture
def cpu_bcg(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Swap only BCG's CUDA-graph primitives for the CPU stand-ins (see cpu_graph_standin)."""
    import torch
    from sglang.srt.runtime_context import get_parallel

    from cpu_graph_standin import FakeGroup, SegmentGraph

    monkeypatch.setattr(torch.cuda, "CUDAGraph", SegmentGraph)
    with get_parallel().override(tp_group=FakeGroup()):
        yield
