"""``python -m sglang_bcg_plugin`` runs the ``sglang-bcg`` command."""

from __future__ import annotations

import sys

from .cli import main

sys.exit(main())
