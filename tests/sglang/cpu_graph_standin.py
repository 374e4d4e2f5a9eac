"""CPU stand-in for the CUDA graph primitive under SGLang's breakable CUDA graph (BCG) engine.

What is stood in, and nothing else:

* ``torch.cuda.CUDAGraph``: one *segment* of SGLang's ``BreakableCUDAGraph``. With a CPU torch,
  constructing it raises ("dummy base class"). :class:`SegmentGraph` replaces it for the
  duration of a test (``monkeypatch.setattr(torch.cuda, "CUDAGraph", SegmentGraph)``; SGLang's
  ``BreakableCUDAGraphCapture._begin_new_segment`` looks the name up at call time).
* the TP group (``get_parallel().tp_group`` from 0.5.22, ``model_runner.tp_group`` before):
  unset in a process that never initialised distributed; a :class:`FakeGroup` whose
  ``barrier()`` does nothing (one rank).
* ``torch.cuda.current_stream``: ``torch.cpu.current_stream`` (releases up to 0.5.22 ask
  ``torch.cuda`` for the stream a capture starts on; 0.5.23 asks the device module).
* a collective recorded in a segment (a ``c10d`` op: gloo on CPU, a tensor-parallel
  all-reduce) replays as one more awaited call of the op; its ``Work`` handle, new at every call,
  is not part of what the segment keeps (a CUDA graph replays the captured NCCL kernel instead).
* the segment engine's ``_weak_ref_if_tensor`` keeps CPU tensors as they are (what 0.5.23's
  does; earlier releases call ``weak_ref_tensors``, which raises on CPU).
* the runner's ``device_module``: ``torch.cpu`` has no ``graph_pool_handle``;
  :class:`FakeDeviceModule` returns the ``(0, 0)`` pool id SGLang uses as "no pool".

Everything else is SGLang's real code: ``BreakableCudaGraphBackend`` (warmups, session, pool
scopes, precarve, dedup mixin, replay), ``BreakableCUDAGraph`` (segments + break functions),
``BreakableCUDAGraphCapture`` (segment splitting) and ``eager_on_graph`` (break points).

How a segment behaves: with our *eager engine* semantics (``sglang_bcg_plugin.engines.eager``:
capture = run and keep the output storage; replay = run again and copy into that storage),
applied per aten op. While a segment is "capturing", a ``TorchDispatchMode`` runs every op
eagerly and keeps it as an :class:`~sglang_bcg_plugin.engines.eager.EagerGraph` whose output is
the op's result; replay re-runs each op in order and copies the fresh result into the kept
storage. So a segment replays the kernels it captured, on the same tensor objects, and writes
the same addresses a CUDA graph would: static inputs are read at replay time, break outputs
(held by SGLang's break functions) are refreshed between segments, and the in-graph copy into a
shared output buffer is replayed. Ops run *between* segments (eager breaks) are not recorded,
exactly as CUDA graph capture would not see them. Like a CUDA graph, it cannot follow Python
control flow that depends on tensor values inside a segment.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sglang_bcg_plugin.engines.eager import EagerGraph


def _without_work(out: Any) -> Any:
    """A collective's result without its ``Work`` handles (a fresh one per call; a CUDA graph has none)."""
    if isinstance(out, (tuple, list)):
        return type(out)(_without_work(o) for o in out)
    return None if isinstance(out, torch.ScriptObject) else out


def _settled(func: Any, args: Any, kwargs: Any) -> Any:
    """Run a collective and wait for it, as the captured kernel's place in the stream would."""
    out = func(*args, **kwargs)
    for leaf in out if isinstance(out, (tuple, list)) else (out,):
        if isinstance(leaf, torch.ScriptObject):
            leaf.wait()
    return _without_work(out)


class _Recorder(TorchDispatchMode):
    def __init__(self, tape: list[EagerGraph]) -> None:
        super().__init__()
        self.tape = tape

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace == "c10d":  # a collective (gloo): replayed as one more call, awaited
            replay = functools.partial(_settled, func, args, kwargs)
            self.tape.append(EagerGraph((func, len(self.tape)), replay, _without_work(out)))
        else:
            self.tape.append(EagerGraph((func, len(self.tape)), functools.partial(func, *args, **kwargs), out))
        return out


class SegmentGraph:
    """Stands in for ``torch.cuda.CUDAGraph`` (the API SGLang's BCG engine calls)."""

    instances = 0

    def __init__(self, keep_graph: bool = False) -> None:
        type(self).instances += 1
        self.tape: list[EagerGraph] = []
        self._mode: _Recorder | None = None

    def capture_begin(self, pool: object = None, capture_error_mode: str = "global") -> None:
        self._mode = _Recorder(self.tape)
        self._mode.__enter__()

    def capture_end(self) -> None:
        assert self._mode is not None
        self._mode.__exit__(None, None, None)
        self._mode = None

    def instantiate(self) -> None:
        """Nothing to instantiate."""

    def replay(self) -> None:
        with torch.no_grad():
            for op in self.tape:
                op.replay()

    def reset(self) -> None:
        self.tape.clear()


class FakeGroup:
    """One-rank tensor-parallel group: ``barrier()`` is all SGLang's BCG backend calls."""

    barriers = 0

    def barrier(self) -> None:
        type(self).barriers += 1


class FakeDeviceModule:
    """The two calls the BCG backend makes on ``runner.device_module``."""

    def synchronize(self) -> None:
        """CPU ops are synchronous."""

    def graph_pool_handle(self) -> tuple[int, int]:
        return (0, 0)


class FakeRunner:
    """What SGLang's BCG backend reads from a graph runner (``base_cuda_graph_runner``)."""

    def __init__(self, *, rows: int | None = None, server_args: object = None, device: str = "cuda") -> None:
        attrs = {"device": device, "server_args": server_args, "tp_group": FakeGroup()}  # tp_group: <= 0.5.21
        self.model_runner = type("ModelRunner", (), attrs)()
        self.device_module = FakeDeviceModule()
        self.rows = rows

    def cuda_graph_output_rows(self, output: object) -> int | None:
        return self.rows

    def cuda_graph_output_capacity_rows(self, output: object) -> int | None:
        return None
