"""Run at start-up of every process of the CPU server test (``site/`` is first on ``PYTHONPATH``):
the launcher or the Engine's process, and the scheduler and detokenizer SGLang spawns.

1. ``torchvision``: no PyPI build works with CPU torch 2.13, and SGLang 0.5.23 imports it on the
   server's import chain (through transformers' image processors); the import stand-in of
   ``tests/sglang/torchvision_standin.py`` is installed (nothing of torchvision runs for text).
2. ``sgl_kernel``: the CPU engine's kernel package is found beside this file (``site/sgl_kernel``,
   whose docstring says what it stands in for).
3. Instrumentation only: SGLang's plugin loader logs at INFO ("Loaded plugin ...", "Executed
   general plugin ...", "Applied N hook(s) to ... (from: plugin=...)") before SGLang configures
   logging in its spawned processes, so those lines are lost there. A handler on the
   ``sglang.srt.plugins`` logger prints them to stderr with the process id
   (``SGLANG_BCG_PLUGIN_LOG pid=N ...``), so the test can tell which process loaded the plugin.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path

_STANDIN = Path(__file__).resolve().parents[2] / "sglang" / "torchvision_standin.py"


def _install_torchvision_standin() -> None:
    spec = importlib.util.spec_from_file_location("torchvision_standin", _STANDIN)
    assert spec is not None and spec.loader is not None, _STANDIN
    module = importlib.util.module_from_spec(spec)
    sys.modules["torchvision_standin"] = module
    spec.loader.exec_module(module)
    module.install()


def _show_plugin_loading() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("SGLANG_BCG_PLUGIN_LOG pid=%(process)d %(message)s"))
    log = logging.getLogger("sglang.srt.plugins")
    log.addHandler(handler)
    log.setLevel(logging.INFO)


_install_torchvision_standin()
_show_plugin_loading()
