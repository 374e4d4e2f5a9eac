"""Import stand-in for the CPU build of ``sgl_kernel`` (SGLang's kernel package), for CI on CPU.

What it stands in for: the eight names SGLang 0.5.23 imports from ``sgl_kernel`` at module level
when its CPU engine is on (``SGLANG_USE_CPU_ENGINE=1``, ``sglang.srt.utils.is_cpu()``), on the
import chain of ``sglang.Engine`` / ``launch_server`` and their scheduler and detokenizer:

* ``copy_all_layer_kv_cache_cpu`` (``sglang/kernels/ops/kvcache/cache_move.py``),
* ``assign_req_to_token_pool_cpu`` (``sglang/srt/mem_cache/allocation.py``),
* ``build_tree_kernel_efficient_cpu``, ``verify_tree_greedy_cpu``
  (``sglang/kernels/ops/speculative/spec_tree.py``),
* ``assign_draft_cache_locs_contiguous_cpu``, ``assign_extend_cache_locs_cpu``
  (``sglang/kernels/ops/speculative/cache_locs.py``),
* ``fill_accept_out_cache_loc_cpu``, ``fill_bonus_tokens_cpu``
  (``sglang/kernels/ops/speculative/eagle.py``).

Why: SGLang's CPU kernels are a separate source build of sgl-kernel (C++ ops for x86 AMX / ARM,
registered as ``torch.ops.sgl_kernel.*``) that is not published on PyPI; the ``sglang-kernel``
wheel on PyPI is a CUDA build for torch 2.14.1 and does not load on CPU torch 2.13.

What runs instead: nothing of it. Each name raises ``NotImplementedError`` naming itself when
called (none is called on the path the server test drives: plain greedy generation without a
radix cache or speculative decoding). No ``torch.ops.sgl_kernel`` operator is registered, so
``sglang.srt.utils.cpu_has_amx_support()`` is False and SGLang takes its own pure-torch paths:
the ``torch_native`` attention backend and every layer's ``forward_native``. Model modules that
reference ``torch.ops.sgl_kernel.*_cpu`` at import (Qwen3.5, Grok, ...) fail to import and SGLang
skips them ("Ignore import error when loading ..."); Llama does not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__version__ = "0.0.0+ci-cpu-standin"
__sglang_bcg_standin__ = True

NAMES = (
    "copy_all_layer_kv_cache_cpu",
    "assign_req_to_token_pool_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
)


def _missing(name: str) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        msg = (
            f"sgl_kernel.{name}: this is the CI stand-in for SGLang's CPU kernels (not on PyPI); "
            "the server test's path was not expected to call it: build sgl-kernel for CPU to run it"
        )
        raise NotImplementedError(msg)

    kernel.__name__ = kernel.__qualname__ = name
    return kernel


for _name in NAMES:
    globals()[_name] = _missing(_name)
del _name
