"""``scripts/server/server_check.py`` speaks the installed release's CLI: the flags it passes for
the prefill breakable graph and the decode batch sizes parse with that release's own
``ServerArgs.add_cli_args`` and switch the breakable graph on (0.5.13: its runner's
``--enable-breakable-cuda-graph``; later: ``--cuda-graph-backend-prefill breakable``)."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.sglang

SERVER_CHECK = Path(__file__).resolve().parents[2] / "scripts" / "server" / "server_check.py"


def _server_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_server_check_flags", SERVER_CHECK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_release_flags_parse_with_the_installed_release() -> None:
    from sglang.srt.server_args import ServerArgs

    release = importlib.metadata.version("sglang")
    flags = _server_check().release_flags()
    assert flags == _server_check().release_flags(release)
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    parsed = parser.parse_args(["--model-path", "m", *flags])
    if release.startswith("0.5.13"):
        assert parsed.enable_breakable_cuda_graph is True and parsed.cuda_graph_max_bs == 16
        assert parsed.sampling_backend == "pytorch"
    else:
        assert parsed.cuda_graph_backend_prefill == "breakable" and parsed.cuda_graph_max_bs_decode == 16
