"""What the installed SGLang's own breakable backend does with outputs: our default inside SGLang.

Installing the plugin must not change SGLang's memory behaviour by itself, so with neither
``--enable-bcg-shared-output`` nor ``SGLANG_ENABLE_BCG_SHARED_OUTPUT`` our SGLang-integrated
backend shares exactly when the installed SGLang's built-in ``BreakableCudaGraphBackend``
would. That is read from the names the installed class's compiled code uses
(:func:`code_names`; no source text), not assumed from a version number:

* ``capture_one`` uses ``_shared_output_buffer`` and ``_copy_output_to_buffer`` and ``__init__``
  sets the buffer: every key's output is copied into one buffer (0.5.14-0.5.23), ``on``; from the
  warmup with ``_alloc_full_buffer`` (0.5.16+), else the first capture's output is adopted;
* 0.5.13's ``BreakableCudaGraphRunner`` (:func:`inspect_runner`) and any class without those
  names keep one output per size or key: ``off``;
* the names present but the code also names a switch (a later SGLang that made sharing
  optional), or no code to read: unknown, so ``off`` (the safe value), and
  ``sglang-bcg doctor`` says so.

Only this backend follows SGLang's default; our standalone backends stay ``off`` by default.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

from ..output_mode import OFF, ON, OutputMode

#: Names whose use in SGLang's ``capture_one`` means "copies every output into one buffer".
SHARING_NAMES = ("_shared_output_buffer", "_copy_output_to_buffer")
#: Used too when the buffer comes from the warmup (0.5.16+); without it the first output is adopted.
WARMUP_BUFFER = "_alloc_full_buffer"
#: Words that would make that sharing conditional (then we cannot tell what SGLang does).
SWITCH_WORDS = ("share_output", "enable_bcg", "reuse_output")


@dataclass(frozen=True, slots=True)
class BuiltinPolicy:
    """Whether SGLang's built-in BCG shares outputs (``None``: cannot tell) and why."""

    shares: bool | None
    reason: str

    @property
    def default_mode(self) -> OutputMode:
        return ON if self.shares else OFF

    def default_reason(self) -> str:
        return f"default: {self.default_mode}, the installed SGLang's own behaviour: {self.reason}"


def code_names(fn: object) -> frozenset[str] | None:
    """The names ``fn``'s compiled code uses (attributes, globals, string constants), nested
    functions included; ``None`` when ``fn`` has no Python code (a builtin, a missing name)."""
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    if code is None:
        return None
    names: set[str] = set()
    stack = [code]
    while stack:
        c = stack.pop()
        names.update(c.co_names)
        for const in c.co_consts:
            if isinstance(const, types.CodeType):
                stack.append(const)
            elif isinstance(const, str):
                names.add(const)
    return frozenset(names)


def inspect_builtin(cls: type) -> BuiltinPolicy:
    """Read ``cls`` (SGLang's ``BreakableCudaGraphBackend`` or a stand-in) for its output policy."""
    name = cls.__qualname__
    capture, init = code_names(getattr(cls, "capture_one", None)), code_names(getattr(cls, "__init__", None))
    if capture is None or init is None:
        return BuiltinPolicy(None, f"cannot read {name}'s code; assuming it does not share")
    if not all(n in capture for n in SHARING_NAMES) or SHARING_NAMES[0] not in init:
        return BuiltinPolicy(False, f"{name}.capture_one keeps one output per shape key")
    words = " ".join(capture).lower()
    switches = [w for w in SWITCH_WORDS if w in words]
    if switches:
        return BuiltinPolicy(
            None, f"{name}.capture_one shares under a switch ({', '.join(switches)}) this plugin does not know; assuming off"
        )
    if WARMUP_BUFFER in capture:
        return BuiltinPolicy(True, f"{name}.capture_one always copies outputs into one _shared_output_buffer")
    return BuiltinPolicy(
        True, f"{name}.capture_one adopts the first capture's output as one _shared_output_buffer and copies the others into it"
    )


def inspect_runner(cls: type) -> BuiltinPolicy:
    """Read SGLang 0.5.13's ``BreakableCudaGraphRunner`` (or a stand-in) for its output policy."""
    name = cls.__qualname__
    found = [n for n in map(code_names, vars(cls).values()) if n is not None]
    if not found:
        return BuiltinPolicy(None, f"cannot read {name}'s code; assuming it does not share")
    if any(s in names for names in found for s in SHARING_NAMES):
        return BuiltinPolicy(None, f"{name} shares outputs in a way this plugin does not know; assuming off")
    return BuiltinPolicy(False, f"{name}._capture_all keeps one output_buffers entry per size")
