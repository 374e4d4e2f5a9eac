"""``sgl_kernel.utils`` of sglbundle's sgl_kernel stand-in.

Real: ``get_cuda_stream()`` (the current CUDA stream's handle, as sgl-kernel's), and
``is_arch_support_pdl()`` (True on compute capability 9.0 and later, which SGLang's triton
attention backend reads in its constructor to decide on programmatic dependent launch; False
where no CUDA device can be queried; cached after the first answer), ``is_hopper_arch()``
(the same test, the name older sgl-kernel wrappers use) and ``_to_tensor_scalar_tuple``.
Every other name is a placeholder that raises ``NotImplementedError`` when called.
"""

from __future__ import annotations

from typing import Any

import torch

_pdl: list[bool] = []  # the cached answer of is_arch_support_pdl (a cache torch.compile can trace past)


def get_cuda_stream() -> int:
    """The raw handle (``cudaStream_t`` as an int) of the current CUDA stream."""
    return int(torch.cuda.current_stream().cuda_stream)


def is_arch_support_pdl() -> bool:
    """Whether the current CUDA device supports programmatic dependent launch (SM 9.0+)."""
    if not _pdl:
        try:
            major, _minor = torch.cuda.get_device_capability(torch.cuda.current_device())
        except (RuntimeError, AssertionError):  # no CUDA device, or torch built without CUDA
            major = 0
        _pdl.append(major >= 9)
    return _pdl[0]


is_hopper_arch = is_arch_support_pdl


def _to_tensor_scalar_tuple(x: Any) -> tuple[torch.Tensor | None, Any]:
    """``(tensor, 0)`` for a tensor argument, ``(None, value)`` for a scalar one."""
    if isinstance(x, torch.Tensor):
        return (x, 0)
    return (None, x)


def __getattr__(name: str) -> Any:  # PEP 562: every other name is a placeholder
    if name.startswith("__") and name.endswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import _placeholder

    value = _placeholder(__name__, name)
    globals()[name] = value
    return value
