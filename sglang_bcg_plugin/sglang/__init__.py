"""SGLang integration: entry point, ``--enable-bcg-shared-output``, backend seam, ``doctor``; importing
it never imports SGLang (the functions below do, when called)."""

from __future__ import annotations

from .doctor import doctor_main
from .hooks import HOOKS, register
from .sglang_breakable import sglang_breakable_backend_class

__all__ = ["HOOKS", "doctor_main", "register", "sglang_breakable_backend_class"]
