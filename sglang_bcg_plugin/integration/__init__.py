"""SGLang integration: entry point, ``--enable-bcg-shared-output`` (and :func:`flag_resolution`,
the flag as an output mode for the core), backend seam, ``doctor``.

Importing this package never imports SGLang; the functions below import it when called.
"""

from __future__ import annotations

from .doctor import doctor_main
from .hooks import HOOKS, register
from .sglang_breakable import sglang_breakable_backend_class
from .stash import flag_resolution

__all__ = ["HOOKS", "doctor_main", "flag_resolution", "register", "sglang_breakable_backend_class"]
