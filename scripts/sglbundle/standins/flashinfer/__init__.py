"""Import stand-in for flashinfer on the GPU machine: its kernels cannot load there.

SGLang's modules import flashinfer (and its submodules) at import time under ``_is_cuda``; our GPU
tests drive SGLang's breakable engine with our own forward functions, which never call it. Every
attribute is a function that raises if called; any ``flashinfer.*`` submodule is fabricated,
except those named in ``SGLBUNDLE_FLASHINFER_ABSENT`` (comma-separated, e.g. ``norm``): importing
them raises ImportError, so a real sgl_kernel that tries ``import flashinfer.norm`` first takes
its own kernels instead of this stand-in's raising functions.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from typing import Any


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)

    def standin(*args: Any, **kwargs: Any) -> Any:
        msg = f"flashinfer stand-in: {name} cannot run here (no flashinfer kernels on this machine)"
        raise RuntimeError(msg)

    if name[:1].isupper():  # a class SGLang may subclass: constructing it raises
        return type(name, (), {"__init__": lambda self, *a, **k: standin()})
    return standin


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        absent = {n.strip() for n in os.environ.get("SGLBUNDLE_FLASHINFER_ABSENT", "").split(",") if n.strip()}
        if fullname.startswith("flashinfer.") and fullname.split(".")[1] not in absent:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = __getattr__  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


sys.meta_path.insert(0, _Finder())
