"""``python -m sglang_bcg_plugin`` runs the ``sglang-bcg`` command."""

from __future__ import annotations

import os
import sys

from .cli import main

code = main()
if code == 130:
    # Interrupted: leave before CPython's ``-m`` ending can turn a caught Ctrl-C into a SIGINT exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(130)
sys.exit(code)
