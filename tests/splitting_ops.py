"""Splitting ops of the piecewise tests, CPU and GPU alike: real ``torch.library`` custom ops.

``mix`` returns a fresh tensor; ``write_softmax`` writes into a buffer the previous piece
allocated (vLLM's attention style). Imported by ``tests/test_piecewise*.py`` and the GPU files
(``tests/`` is on ``sys.path`` through its ``conftest.py``).
"""

from __future__ import annotations

import torch


@torch.library.custom_op("sglang_bcg_test::mix", mutates_args=())
def mix(x: torch.Tensor) -> torch.Tensor:
    """Splitting op returning a fresh tensor."""
    return torch.tanh(x) + 1.0


@mix.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("sglang_bcg_test::write_softmax", mutates_args=("out",))
def write_softmax(x: torch.Tensor, out: torch.Tensor) -> None:
    """Splitting op writing into a buffer the previous piece allocated."""
    out.copy_(torch.softmax(x, dim=-1))


@write_softmax.register_fake
def _(x: torch.Tensor, out: torch.Tensor) -> None:
    return None


#: Both ops, the second as the overload a graph calls.
OPS = [mix, torch.ops.sglang_bcg_test.write_softmax.default]


#: What ``heads_mix`` received, in call order: (seq length, contiguous). Tests clear it.
SEEN_CONTIGUOUS: list[tuple[int, bool]] = []


@torch.library.custom_op("sglang_bcg_test::heads_mix", mutates_args=())
def heads_mix(x: torch.Tensor) -> torch.Tensor:
    """Splitting op reading a ``[heads, seq, d]`` view as attention does; notes its layout."""
    SEEN_CONTIGUOUS.append((x.shape[1], x.is_contiguous()))
    return (torch.tanh(x) + 1.0).transpose(0, 1).contiguous()


@heads_mix.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[1], x.shape[0], x.shape[2])


#: Storage weak references of what ``fresh_triple`` returned, and what ``probe_expired`` saw.
MADE: list[object] = []
EXPIRED: list[bool] = []


@torch.library.custom_op("sglang_bcg_test::fresh_triple", mutates_args=())
def fresh_triple(x: torch.Tensor) -> torch.Tensor:
    """Splitting op returning a fresh tensor whose storage it remembers (``MADE``)."""
    out = x * 3.0
    MADE.append(torch.multiprocessing.reductions.StorageWeakRef(out.untyped_storage()))
    return out


@fresh_triple.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("sglang_bcg_test::probe_expired", mutates_args=())
def probe_expired(x: torch.Tensor) -> torch.Tensor:
    """Not a splitting op: runs inside a compiled piece and notes whether the last
    ``fresh_triple`` result is freed by then (``EXPIRED``)."""
    EXPIRED.append(MADE[-1].expired())  # type: ignore[attr-defined]
    return x + 1.0


@probe_expired.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)
