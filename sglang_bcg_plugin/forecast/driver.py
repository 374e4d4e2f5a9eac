"""The CUDA driver's share of a capture session, outside PyTorch's allocator: ``first capture +
per graph * graphs + per node * nodes``, counted while the probes capture (docs/forecast.md)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import sys
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

KIB = 1024
MIB = 1024 * KIB


@dataclass(frozen=True, slots=True)
class DriverCoefficients:
    """The driver's bytes once per process at its first capture, per graph, per node and per size."""

    first_capture_bytes: int
    per_graph_bytes: int
    per_node_bytes: int
    measured_on: str
    per_size_bytes: int = 0

    def bytes_for(self, graphs: float, nodes: float, *, first_capture: bool = True, sizes: float = 0) -> int:
        """The driver's bytes for ``graphs`` alive at once, ``nodes`` in all, over ``sizes`` sizes."""
        return round((self.first_capture_bytes if first_capture else 0) + graphs * self.per_graph_bytes
                     + nodes * self.per_node_bytes + sizes * self.per_size_bytes)


#: The one place the driver's coefficients live (how each was fitted:
#: docs/forecast.md#the-drivers-share-how-it-is-modelled).
DRIVER_COEFFICIENTS = DriverCoefficients(69 * MIB, 106 * KIB, 2560, "NVIDIA H200, torch 2.11.0+cu130",
                                         per_size_bytes=41 * KIB)


@dataclass(frozen=True, slots=True)
class DriverShare:
    """The driver's share of one schedule's capture (its fields: docs/forecast.md#the-drivers-share-how-it-is-modelled);
    ``paid_bytes``, where measured, stands for ``launch_bytes`` and the first capture."""

    graphs: int
    nodes: int
    on_copy_nodes: int = 0
    first_capture: bool = True
    nodes_counted: bool = True
    coefficients: DriverCoefficients = DRIVER_COEFFICIENTS
    launch_bytes: int = 0
    paid_bytes: int | None = None
    sizes: int = 0

    @property
    def once_bytes(self) -> int:
        """What the process pays once: ``paid_bytes``, else the first launches and first capture."""
        if self.paid_bytes is not None:
            return self.paid_bytes
        return self.launch_bytes + (self.coefficients.first_capture_bytes if self.first_capture else 0)

    def bytes_for(self, mode: str) -> int:
        """The driver's bytes with output mode ``mode``."""
        return self.per_size_bytes(1, mode)[0]

    def per_size_bytes(self, sizes: int, mode: str) -> tuple[int, int]:
        """The first size's bytes (with what the process pays once) and every other size's, the
        graphs and nodes split evenly over ``sizes``."""
        all_nodes = self.nodes + (self.on_copy_nodes if mode == "on" else 0)
        graphs, nodes = self.graphs / max(sizes, 1), all_nodes / max(sizes, 1)
        each = self.coefficients.bytes_for(graphs, nodes, first_capture=False, sizes=self.sizes / max(sizes, 1))
        return self.once_bytes + each, each

    def describe(self) -> str:
        nodes = f"{self.nodes:,} nodes" if self.nodes_counted else "nodes not counted"
        nodes += f", {self.sizes:,} sizes" if self.sizes else ""
        first = "with" if self.first_capture else "without"
        launches = f", first launches {self.launch_bytes / MIB:.1f} MiB" if self.launch_bytes else ""
        paid = "" if self.paid_bytes is None else (
            f"; {self.paid_bytes / MIB:.1f} MiB measured once in place of both")
        return f"{self.graphs:,} graphs, {nodes}, {first} the first-capture cost{launches}{paid}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class ProbeCount:
    """The graphs one probe capture made (``nodes``: ``None`` where any could not be read)."""

    size: int
    graphs: int
    nodes: int | None

    @classmethod
    def of(cls, size: int, ended: Sequence[int | None]) -> ProbeCount:
        """The count of the captures that ``ended`` with those nodes (0: an empty graph, not counted)."""
        graphs = [n for n in ended if n != 0]
        return cls(size, len(graphs), None if None in graphs else sum(graphs))  # type: ignore[arg-type]


def schedule_share(probes: Sequence[ProbeCount], sizes: Sequence[int], *, on_copy_nodes_per_size: int = 0,
                   first_capture: bool = True, coefficients: DriverCoefficients = DRIVER_COEFFICIENTS) -> DriverShare:
    """The :class:`DriverShare` of capturing ``sizes``: each size's graphs and nodes on the line through the probes'."""
    counted = all(p.nodes is not None for p in probes)
    captured = len(sizes)
    if not any(p.graphs for p in probes):  # no graph seen: nothing per graph, per size or per copy node
        on_copy_nodes_per_size = captured = 0
    ordered = sorted(probes, key=lambda p: p.size)
    graphs = sum(_at(ordered, n, lambda p: p.graphs) for n in sizes)
    nodes = sum(_at(ordered, n, lambda p: p.nodes or 0) for n in sizes) if counted else 0
    return DriverShare(graphs, nodes, on_copy_nodes_per_size * len(sizes), first_capture, counted, coefficients,
                       sizes=captured)


def probe_driver_share(counts: Sequence[ProbeCount], lost: int, schedule: Sequence[int], output_tensors: int
                       ) -> DriverShare:
    """The driver's share of ``schedule`` (:func:`schedule_share`), with the first-capture
    cost where the probes lost at least half of it beyond the allocator (``lost``)."""
    first = lost >= DRIVER_COEFFICIENTS.first_capture_bytes // 2
    return schedule_share(counts, schedule, on_copy_nodes_per_size=output_tensors, first_capture=first)


def _at(ordered: Sequence[ProbeCount], size: int, value: Any) -> int:
    if not ordered:
        return 0
    lo, hi = ordered[0], ordered[-1]
    if hi.size == lo.size:
        return int(value(hi))
    return max(0, round(value(lo) + (value(hi) - value(lo)) * (size - lo.size) / (hi.size - lo.size)))


# -- counting the graphs and their nodes while they are captured ----------------------------------
@contextlib.contextmanager
def counting_captures() -> Iterator[list[int | None]]:
    """While open, every ``torch.cuda.CUDAGraph.capture_end`` that returns appends its graph's nodes
    (read just before: :func:`capture_nodes`) to the list it yields (:meth:`ProbeCount.of` counts them)."""
    from unittest import mock

    import torch

    original = torch.cuda.CUDAGraph.capture_end
    ended: list[int | None] = []

    @functools.wraps(original)
    def capture_end(self: Any, *args: Any, **kwargs: Any) -> Any:
        nodes = capture_nodes()
        result = original(self, *args, **kwargs)
        ended.append(nodes)
        return result

    with mock.patch.object(torch.cuda.CUDAGraph, "capture_end", capture_end):  # restored as it was, own or inherited
        yield ended


_CAPTURE_ACTIVE = 1  # CU_STREAM_CAPTURE_STATUS_ACTIVE


@functools.cache
def driver_api() -> tuple[tuple[Any, int, Any] | None, str]:
    """The driver functions that read a capture's nodes (``cuStreamGetCaptureInfo_v3`` or ``_v2``,
    the NULL arguments it takes after the graph, ``cuGraphGetNodes``), or ``None`` and why not."""
    if not sys.platform.startswith("linux"):
        return None, f"node counting reads libcuda.so.1 (Linux); this is {sys.platform}"
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return None, f"libcuda.so.1 could not be loaded ({exc})"
    versions = (("cuStreamGetCaptureInfo_v3", 3), ("cuStreamGetCaptureInfo_v2", 2))
    info, extra = next(((getattr(lib, name), nulls) for name, nulls in versions if hasattr(lib, name)), (None, 0))
    nodes = getattr(lib, "cuGraphGetNodes", None)
    if info is None or nodes is None:
        return None, "libcuda.so.1 has no cuStreamGetCaptureInfo_v2/_v3 or cuGraphGetNodes"
    ptr, out = ctypes.c_void_p, ctypes.POINTER
    # (stream, status*, id*, graph*, deps**, [edgeData**,] numDeps*) -> CUresult
    info.argtypes = [ptr, out(ctypes.c_int), out(ctypes.c_uint64), out(ptr)] + [ptr] * extra
    info.restype = ctypes.c_int
    nodes.argtypes = [ptr, ptr, out(ctypes.c_size_t)]  # (graph, nodes*, numNodes*)
    nodes.restype = ctypes.c_int
    return (info, extra, nodes), ""


def capture_nodes() -> int | None:
    """Nodes of the graph the current stream is capturing into (``None``: not capturing, or unread)."""
    api, _ = driver_api()
    if api is None:
        return None
    capture_info, extra, graph_nodes = api
    try:
        import torch

        stream = torch.cuda.current_stream().cuda_stream
        status, ident, graph = ctypes.c_int(0), ctypes.c_uint64(0), ctypes.c_void_p(0)
        rc = capture_info(ctypes.c_void_p(stream), ctypes.byref(status), ctypes.byref(ident), ctypes.byref(graph),
                          *([None] * extra))
        count = ctypes.c_size_t(0)
        if rc != 0 or status.value != _CAPTURE_ACTIVE or not graph.value or (
                graph_nodes(graph, None, ctypes.byref(count)) != 0):
            return None
        return int(count.value)
    except Exception:  # noqa: BLE001 - a count is optional; the capture must not fail for it
        return None
