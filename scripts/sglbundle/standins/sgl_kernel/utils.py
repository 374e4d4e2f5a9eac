"""``sgl_kernel.utils`` of the stand-in: what SGLang's triton attention backend calls."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=1)
def is_arch_support_pdl() -> bool:
    """Whether the GPU can do programmatic dependent launch (compute capability 9.0 or newer)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def get_cuda_stream() -> int:
    """The current CUDA stream's handle."""
    return int(torch.cuda.current_stream().cuda_stream)
