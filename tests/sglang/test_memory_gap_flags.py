"""``scripts/server/memory_gap.py`` speaks the installed release's CLI: its command parses with that
release's own ``ServerArgs.add_cli_args``, leaves the static fraction, the KV tokens, the chunk and
the decode graphs' batch to SGLang (unset), and sets the chunk and the decode batch when asked."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.sglang

MEMORY_GAP = Path(__file__).resolve().parents[2] / "scripts" / "server" / "memory_gap.py"


def _memory_gap() -> ModuleType:
    if "_memory_gap_flags" in sys.modules:
        return sys.modules["_memory_gap_flags"]
    spec = importlib.util.spec_from_file_location("_memory_gap_flags", MEMORY_GAP)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _parse(cmd: list[str], variant: str) -> argparse.Namespace:
    """SGLang's own parser; the plugin's flag is the plugin's (added where it is installed)."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert cmd[1:3] == ["-m", "sglang.launch_server"], cmd[:3]
    parsed, rest = parser.parse_known_args(cmd[3:])
    assert rest == (["--enable-bcg-shared-output"] if variant == "plugin-on" else []), rest
    return parsed


@pytest.mark.parametrize("variant", ["stock", "post-capture", "plugin-on"])
def test_sglang_sizes_itself_unless_asked(variant: str) -> None:
    gap = _memory_gap()
    release = importlib.metadata.version("sglang")
    parsed = _parse(gap.server_command("/tmp/model", 30000, variant), variant)
    assert parsed.mem_fraction_static is None and parsed.max_total_tokens is None
    assert parsed.chunked_prefill_size is None
    decode_bs = "cuda_graph_max_bs" if release.startswith("0.5.13") else "cuda_graph_max_bs_decode"
    assert getattr(parsed, decode_bs) is None
    asked = _parse(gap.server_command("/tmp/model", 30000, variant, chunk=4096, decode_max_bs=48), variant)
    assert asked.chunked_prefill_size == 4096 and getattr(asked, decode_bs) == 48
    assert asked.mem_fraction_static is None and asked.max_total_tokens is None
