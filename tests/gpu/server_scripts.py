"""The real-server GPU tests' shared pieces: ``scripts/server``'s modules loaded by path (they are
scripts, not a package) and the markers that skip a test without a GPU or a server bundle."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

SERVER = Path(__file__).resolve().parents[2] / "scripts" / "server"

#: A module needs a CUDA GPU and a server bundle set up (``scripts/server/setup.sh`` exports
#: ``PLUGIN_SITE``; ``scripts/server/gpu-server-check.sh`` does all of it).
NEEDS_SERVER = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the H200 machine)"),
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None or not os.environ.get("PLUGIN_SITE"),
                       reason="needs a server bundle set up (scripts/server/gpu-server-check.sh)"),
]


def load(name: str) -> Any:
    """``scripts/server/NAME.py`` as a module (once per process)."""
    key = f"_server_{name}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, SERVER / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    spec.loader.exec_module(module)
    return module
