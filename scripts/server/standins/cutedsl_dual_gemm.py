"""Stand-in for ``sglang.kernels.ops.gemm.cutedsl_dual_gemm`` on a GPU machine without NVIDIA's
CUTLASS DSL (``cutlass``/``cute``), which the real module imports at its top.

SGLang's bf16 Llama MLP imports this module on CUDA (``layers/dual_gemm.py``) to ask whether a
fused gate/up dual GEMM can run. Here the answer is always no (``can_use_dual_gemm`` returns
False), so SGLang takes its own unfused path (two GEMMs, then ``SiluAndMul``): the same values,
no CUTLASS kernel. The constants are the ones the importing code reads.
"""

from enum import IntEnum

MAX_DUAL_GEMM_DECODE_TOKENS = 16


class DualGemmQuantMode(IntEnum):
    STATIC_PER_TENSOR = 0
    STATIC_PER_TOKEN = 1
    DYNAMIC_PER_TENSOR = 2
    DYNAMIC_PER_TOKEN = 3
    UNQUANT = 4


def can_use_dual_gemm(*args: object, **kwargs: object) -> bool:
    """Never: the CUTLASS DSL this kernel needs is not installed."""
    return False
