"""What the graph being captured holds, by node type, and its kernels' parameter bytes: a
diagnostic for the forecast's driver term (docs/forecast.md, "The driver's share"). Not a test.

``census()`` reads the graph the current stream is capturing into through libcuda
(``cuGraphGetNodes``, ``cuGraphNodeGetType``, ``cuGraphKernelNodeGetParams_v2``,
``cuFuncGetParamInfo``). ``install(directory)`` wraps ``torch.cuda.CUDAGraph.capture_end`` so
that every capture of the process appends its census as one JSON line to
``directory/census-PID.jsonl`` (``census_site/sitecustomize.py`` does that in every process of a
server when ``BCG_GRAPH_CENSUS`` names a directory).
"""

from __future__ import annotations

import ctypes
import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "child", 5: "empty", 6: "wait_event",
         7: "event_record", 8: "sem_signal", 9: "sem_wait", 10: "mem_alloc", 11: "mem_free",
         12: "batch_mem_op", 13: "conditional"}
_lib: Any = None


def _driver() -> Any:
    global _lib
    if _lib is None:
        _lib = ctypes.CDLL("libcuda.so.1")
    return _lib


def _capturing_graph(stream: int) -> int | None:
    lib = _driver()
    status, ident, graph = ctypes.c_int(0), ctypes.c_uint64(0), ctypes.c_void_p(0)
    fn = getattr(lib, "cuStreamGetCaptureInfo_v3", None)
    extra = 3
    if fn is None:
        fn, extra = lib.cuStreamGetCaptureInfo_v2, 2
    rc = fn(ctypes.c_void_p(stream), ctypes.byref(status), ctypes.byref(ident), ctypes.byref(graph),
            *([None] * extra))
    return graph.value if rc == 0 and status.value == 1 and graph.value else None


def _param_bytes(func: int, cache: dict[int, int]) -> int:
    if func in cache:
        return cache[func]
    lib = _driver()
    total, off, size = 0, ctypes.c_size_t(0), ctypes.c_size_t(0)
    for i in range(4096):
        if lib.cuFuncGetParamInfo(ctypes.c_void_p(func), ctypes.c_size_t(i), ctypes.byref(off), ctypes.byref(size)):
            break
        total = max(total, off.value + size.value)
    cache[func] = total
    return total


_PARAM_CACHE: dict[int, int] = {}


def census(stream: int | None = None) -> dict[str, Any] | None:
    """The capturing graph's nodes by type, its kernel nodes' parameter bytes (sum, and how many
    kernels could not be read), its distinct kernel functions; ``None`` when not capturing."""
    import torch

    lib = _driver()
    graph = _capturing_graph(torch.cuda.current_stream().cuda_stream if stream is None else stream)
    if graph is None:
        return None
    n = ctypes.c_size_t(0)
    lib.cuGraphGetNodes(ctypes.c_void_p(graph), None, ctypes.byref(n))
    nodes = (ctypes.c_void_p * max(n.value, 1))()
    lib.cuGraphGetNodes(ctypes.c_void_p(graph), nodes, ctypes.byref(n))
    types: Counter[str] = Counter()
    params, unread, funcs = 0, 0, set()
    buf = (ctypes.c_uint8 * 256)()
    for i in range(n.value):
        t = ctypes.c_int(-1)
        lib.cuGraphNodeGetType(ctypes.c_void_p(nodes[i]), ctypes.byref(t))
        types[TYPES.get(t.value, str(t.value))] += 1
        if t.value != 0:
            continue
        if lib.cuGraphKernelNodeGetParams_v2(ctypes.c_void_p(nodes[i]), buf):
            unread += 1
            continue
        func = ctypes.c_void_p.from_buffer(buf, 0).value
        if not func:
            kern = ctypes.c_void_p.from_buffer(buf, 56).value
            out = ctypes.c_void_p(0)
            if not kern or lib.cuKernelGetFunction(ctypes.byref(out), ctypes.c_void_p(kern)):
                unread += 1
                continue
            func = out.value
        funcs.add(func)
        params += _param_bytes(func, _PARAM_CACHE)
    return {"nodes": n.value, "types": dict(types), "kernel_param_bytes": params, "kernels_unread": unread,
            "distinct_kernels": len(funcs)}


def install(directory: str) -> None:
    """Every capture of this process appends its census to ``directory/census-PID.jsonl``."""
    import torch

    path = Path(directory) / f"census-{os.getpid()}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    cls = torch.cuda.CUDAGraph
    original = cls.capture_end

    def capture_end(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            row = census()
        except Exception as exc:  # noqa: BLE001 - a diagnostic must not fail a capture
            row = {"error": repr(exc)}
        result = original(self, *args, **kwargs)
        if row is not None:
            free = torch.cuda.mem_get_info()[0]
            row.update(t=time.time(), free=free, reserved=torch.cuda.memory_reserved())
            with path.open("a") as f:
                f.write(json.dumps(row) + "\n")
        return result

    cls.capture_end = capture_end  # type: ignore[method-assign]
