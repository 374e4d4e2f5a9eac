"""``python -m sglang_bcg_plugin`` runs the ``sglang-bcg`` command."""

from __future__ import annotations

import os
import sys

from .cli import main

code = main()
if code == 130:
    # Interrupted (Ctrl-C: ``error: interrupted`` is printed, the out-dir lock released). Under
    # ``-m`` CPython ends the process by SIGINT after a clean exit when the KeyboardInterrupt
    # passed through code run from a string (``exec``/``eval`` of source, as ``dataclasses`` and
    # ``namedtuple`` do while a module imports): ``Py_RunMain`` checks a flag that catching the
    # exception does not clear. Leave before that check, so the status is always 130.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(130)
sys.exit(code)
