"""What the installed SGLang's own breakable backend does with outputs: our default inside SGLang.

Installing the plugin must not change SGLang's memory behaviour by itself, so with neither
``--enable-bcg-shared-output`` nor ``SGLANG_ENABLE_BCG_SHARED_OUTPUT`` our SGLang-integrated
backend shares exactly when the installed SGLang's built-in ``BreakableCudaGraphBackend``
would. That is *detected* from the installed class, not assumed from a version number:

* 0.5.16 to 0.5.23: ``__init__`` creates ``_shared_output_buffer`` and ``capture_one`` allocates
  it from the warmup (``_alloc_full_buffer``) and copies every key's output into it
  (``_copy_output_to_buffer``), with no switch around it: it **always** shares, so ``on``;
* 0.5.14 and 0.5.15: ``capture_one`` adopts the first capture's output as
  ``_shared_output_buffer`` and copies later outputs into it: sharing too, so ``on``;
* 0.5.13's ``BreakableCudaGraphRunner`` keeps one ``output_buffers[num_tokens]`` per size
  (:func:`inspect_runner`): ``off``;
* a class without those names does not share: ``off``;
* the names present but the source also mentions a switch (a later SGLang that made sharing
  optional), or no source to read: unknown, so ``off`` (the safe value: one output per key),
  and ``sglang-bcg doctor`` says so.

Only this backend follows SGLang's default; our standalone backends stay ``off`` by default.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from ..output_mode import OFF, ON, OutputMode

#: Names whose presence in SGLang's ``capture_one`` means "copies every output into one buffer".
SHARING_NAMES = ("_shared_output_buffer", "_copy_output_to_buffer")
#: Present too when the buffer comes from the warmup (0.5.16+); without it the first output is adopted.
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


def inspect_builtin(cls: type) -> BuiltinPolicy:
    """Read ``cls`` (SGLang's ``BreakableCudaGraphBackend`` or a stand-in) for its output policy."""
    name = cls.__qualname__
    try:
        capture = inspect.getsource(getattr(cls, "capture_one"))  # noqa: B009 - any class may come
        init = inspect.getsource(getattr(cls, "__init__"))  # noqa: B009
    except (OSError, TypeError, AttributeError) as exc:
        return BuiltinPolicy(None, f"cannot read {name}'s source ({type(exc).__name__}); assuming it does not share")
    if not all(n in capture for n in SHARING_NAMES) or SHARING_NAMES[0] not in init:
        return BuiltinPolicy(False, f"{name}.capture_one keeps one output per shape key")
    switches = [w for w in SWITCH_WORDS if w in capture.lower()]
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
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError) as exc:
        return BuiltinPolicy(None, f"cannot read {name}'s source ({type(exc).__name__}); assuming it does not share")
    if any(n in source for n in SHARING_NAMES):
        return BuiltinPolicy(None, f"{name} shares outputs in a way this plugin does not know; assuming off")
    return BuiltinPolicy(False, f"{name}._capture_all keeps one output_buffers entry per size")
