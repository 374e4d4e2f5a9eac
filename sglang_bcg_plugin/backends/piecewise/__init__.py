"""Piecewise backend: ``torch.compile`` split at splitting ops, one CUDA graph per piece per key (docs/piecewise.md)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ...errors import SplittingOpError as SplittingOpError  # re-exported
from ...manager import hookimpl
from ...registry import BackendRegistry
from ..base import CaptureBackend
from .compile import DynamicMode, PiecewiseCompiled, PiecewiseCompiler, capture_size
from .compile import PiecewiseCompileError as PiecewiseCompileError  # re-exported
from .inductor import InductorPieces
from .ops import resolve_splitting_ops
from .front import PieceFront
from .split import SplitSummary


class PiecewiseBackend(CaptureBackend):
    """Piecewise CUDA graphs of a ``torch.compile``-d model, split at ``splitting_ops``.

    :param splitting_ops: ops that run eagerly between pieces (``OpOverload``, ``OpOverloadPacket`` or
        ``torch.library.custom_op`` objects). torch's own ops (aten) split only where the model calls them itself
        (``torch.ops.aten.mm.default(...)``): dynamo's graph holds the torch functions a model calls; one the graph
        never calls is a ``PiecewiseCompileError`` at the first call.
    :param inductor: compile every piece with Inductor before it is captured (off by default).
    :param inductor_config: Inductor config patches for the pieces (only with ``inductor=True``).
    :raises TypeError: ``inductor`` is not a bool.
    :raises SplittingOpError: (a ``TypeError`` and a ``ValueError``) ``splitting_ops`` is not a list of ops, or holds a
        packet without overloads.
    :raises ValueError: ``inductor_config`` without ``inductor=True``."""

    name = "piecewise"
    _front = PieceFront

    def __init__(self, *, splitting_ops: Iterable[object] | None = (), inductor: bool = False,
                 inductor_config: Mapping[str, Any] | None = None, **base: Any) -> None:
        """``base``: :class:`CaptureBackend`'s ``options``, ``plugin_manager``, ``output_mode``."""
        self._splitting_ops = resolve_splitting_ops(splitting_ops)
        if not isinstance(inductor, bool):
            raise TypeError(f"inductor must be a bool, got {inductor!r}")
        if inductor_config is not None and not inductor:
            raise ValueError("inductor_config is given but inductor=False; pass inductor=True to compile the pieces")
        self._inductor = InductorPieces(inductor_config) if inductor else None
        super().__init__(**base)
        self._summaries: list[SplitSummary] = []
        self._compilers: list[PiecewiseCompiler] = []  # not the compiled callables: they hold the model

    @property
    def splitting_ops(self) -> tuple[torch._ops.OpOverload, ...]:
        """The resolved splitting ops (packets expanded to their overloads)."""
        return self._splitting_ops

    def compile(self, model: Callable[..., Any], *, dynamic: DynamicMode = "auto",  # type: ignore[override]
                dynamic_dim: int = 0) -> PiecewiseCompiled:
        """Compile ``model`` (``fullgraph=True``) with this backend's piecewise compile backend.

        :param dynamic: how the size dim is made dynamic: ``"auto"`` (``"size_oblivious"`` with
            Inductor, else ``"unbacked"``), ``"unbacked"``, ``"size_oblivious"`` or ``"backed"``.
        :param dynamic_dim: the dim that varies with the capture size (1 for batch-first inputs)."""
        compiler = PiecewiseCompiler(self._splitting_ops, self._summaries.append, self._inductor)
        self._compilers.append(compiler)
        return PiecewiseCompiled(model, compiler, dynamic=dynamic, dynamic_dim=dynamic_dim)

    @property
    def inductor(self) -> bool:
        """Whether the pieces are compiled by Inductor."""
        return self._inductor is not None

    @property
    def num_piece_compilations(self) -> int:
        """Inductor compilations of pieces (one per piece per dynamo compilation; 0 when off)."""
        return 0 if self._inductor is None else self._inductor.num_compilations

    @property
    def inductor_seconds(self) -> float:
        """Seconds spent compiling pieces with Inductor (part of :attr:`compile_seconds`)."""
        return 0.0 if self._inductor is None else self._inductor.seconds

    @property
    def compile_seconds(self) -> float:
        """Wall seconds of the calls that compiled (dynamo, split, Inductor, first run); paid by
        warmups, so also inside the per-key capture seconds."""
        return sum(c.compile_seconds for c in self._compilers)

    @property
    def split_summaries(self) -> tuple[SplitSummary, ...]:
        """One summary per compilation of a callable returned by :meth:`compile`."""
        return tuple(self._summaries)

    @property
    def num_compilations(self) -> int:
        """How many FX graphs the compile backend received (1 per model if no recompiles)."""
        return len(self._summaries)

    def size_context(self, size: int) -> contextlib.AbstractContextManager[None]:
        """The compiled callables know ``size``: they mark the arguments of that extent dynamic."""
        return capture_size(size)


@hookimpl
def sglang_bcg_register_backends(registry: BackendRegistry) -> None:
    registry.add("piecewise", PiecewiseBackend)
