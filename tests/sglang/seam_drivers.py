"""Drive the installed release's breakable graph through our plugin, the same way on either seam.

* backend seam (0.5.14+): our subclass of SGLang's ``BreakableCudaGraphBackend``, one capture
  session over every key, ``replay()`` as SGLang's runners call it;
* runner seam (0.5.13): SGLang's real ``BreakableCudaGraphRunner._capture_all`` /
  ``_capture_one`` with our two hooks around them (as ``HookRegistry`` installs them), on a runner
  instance that carries only what that capture loop reads; replay is what the runner's own
  ``replay`` does with a size (``graphs[n].replay()``, then ``output_buffers[n]``).

Only the CUDA primitives are stood in (``cpu_graph_standin``, fixture ``cpu_bcg``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import importlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from cpu_graph_standin import FakeDeviceModule, FakeRunner

Forward = Callable[[], Any]


class BackendDriver:
    """Our backend subclass on the backend seam."""

    def __init__(self, runner: Any = None) -> None:
        from sglang_bcg_plugin.sglang import sglang_breakable_backend_class

        self.backend = sglang_breakable_backend_class()(runner or FakeRunner())

    def key(self, size: int, stream_idx: int | None = None) -> Any:
        from sglang.srt.model_executor.runner.shape_key import ShapeKey

        return ShapeKey(size=size, stream_idx=stream_idx)

    def capture(self, forwards: dict[Any, Forward]) -> None:
        with self.backend.capture_session(None):
            for key, forward in forwards.items():
                self.backend.capture_one(key, forward)

    def replay(self, key: Any) -> Any:
        with self.backend.replay_session():
            return self.backend.replay(key, None)

    def report(self) -> Any:
        return self.backend.memory_report()

    def outputs(self) -> list[Any]:
        return list(self.backend._outputs.values())  # private: SGLang's outputs, no public read

    def cleanup(self) -> None:
        self.backend.cleanup()


class RunnerDriver:
    """SGLang 0.5.13's ``BreakableCudaGraphRunner`` capture loop with our hooks around it."""

    def __init__(self, monkeypatch: Any, *, cuda: bool = False, hooked: bool = True) -> None:
        """``cuda``: real CUDA graphs on a side stream in a fresh pool (the GPU test);
        ``hooked=False``: SGLang's own capture loop without our hooks (the built-in to compare)."""
        from sglang_bcg_plugin.sglang import runner_seam

        module = importlib.import_module("sglang.srt.model_executor.breakable_cuda_graph_runner")
        cls = module.BreakableCudaGraphRunner
        # SGLang's own methods, also when an earlier driver of this test wrapped them
        original_all, original_one = inspect.unwrap(cls._capture_all), inspect.unwrap(cls._capture_one)
        # As HookRegistry's AROUND hooks wrap them (tests/sglang/test_sglang_hooks_applied.py
        # checks load_plugins() installs exactly these).
        @functools.wraps(original_all)
        def capture_all(self: Any) -> Any:
            return runner_seam.around_capture_all(capture_all.__wrapped__, self)  # type: ignore[attr-defined]

        @functools.wraps(original_one)
        def capture_one(self: Any, n: int, pool: Any, stream: Any) -> Any:
            return runner_seam.around_capture_one(capture_one.__wrapped__, self, n, pool, stream)  # type: ignore[attr-defined]

        monkeypatch.setattr(cls, "_capture_all", capture_all if hooked else original_all)
        monkeypatch.setattr(cls, "_capture_one", capture_one if hooked else original_one)
        stream = torch.cuda.Stream() if cuda else None
        pool = torch.cuda.graph_pool_handle() if cuda else (0, 0)

        @contextlib.contextmanager
        def graph_capture() -> Iterator[Any]:
            if stream is None:
                yield type("GraphCaptureContext", (), {"stream": None})()
                return
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                yield type("GraphCaptureContext", (), {"stream": stream})()
            torch.cuda.current_stream().wait_stream(stream)

        monkeypatch.setattr(module, "graph_capture", graph_capture)
        monkeypatch.setattr(module, "get_tensor_model_parallel_rank", lambda: 1)  # no tqdm / memory query
        monkeypatch.setattr(module, "get_global_graph_memory_pool", lambda: pool)
        self.module = module
        self.runner = object.__new__(cls)
        from cpu_graph_standin import FakeGroup

        server_args = type("ServerArgs", (), {"enable_cudagraph_gc": False})()
        self.runner.model_runner = type(
            "ModelRunner", (), {"server_args": server_args, "tp_group": FakeGroup(), "attn_backend": None}
        )()
        self.runner.device_module = torch.cuda if cuda else FakeDeviceModule()
        self.runner.graphs, self.runner.output_buffers = {}, {}
        self.forwards: dict[int, Forward] = {}
        # private: 0.5.13's runner loop calls these SGLang methods; the stand-in replaces them
        self.runner._build_capture_forward_batch = lambda n: n
        self.runner._init_forward_metadata_for_capture = lambda fb, n: None
        self.runner._run_forward = self._run_forward

    def _run_forward(self, forward_batch: Any, num_tokens: int) -> Any:
        return self.forwards[num_tokens]()

    def key(self, size: int, stream_idx: int | None = None) -> Any:
        from sglang_bcg_plugin.shape_key import ShapeKey

        assert stream_idx is None, "0.5.13's runner has one stream"
        return ShapeKey(size)

    def capture(self, forwards: dict[Any, Forward]) -> None:
        self.forwards = {key.size: f for key, f in forwards.items()}
        self.runner.capture_num_tokens = sorted(self.forwards)  # _capture_all goes largest first
        self.runner._capture_all()  # private: the SGLang method the runner seam hooks

    def replay(self, key: Any) -> Any:
        from sglang.srt.model_executor.breakable_cuda_graph.context import enable_breakable_cuda_graph

        with enable_breakable_cuda_graph():
            self.runner.graphs[key.size].replay()
        return self.runner.output_buffers[key.size]

    def report(self) -> Any:
        from sglang_bcg_plugin.sglang.runner_seam import runner_report

        return runner_report(self.runner)

    def outputs(self) -> list[Any]:
        return list(self.runner.output_buffers.values())

    def cleanup(self) -> None:
        from sglang_bcg_plugin.sglang.runner_seam import runner_state

        runner_state(self.runner).clear()
        self.runner.graphs.clear()
        self.runner.output_buffers.clear()


def make_driver(monkeypatch: Any) -> BackendDriver | RunnerDriver:
    from conftest import seam

    return RunnerDriver(monkeypatch) if seam().kind == "runner" else BackendDriver()


def storages(outputs: list[Any]) -> set[int]:
    from sglang_bcg_plugin.output.trees import flatten

    return {t.untyped_storage().data_ptr() for out in outputs for _, t in flatten(out)[1]}


def close(a: Any, b: Any) -> None:
    """Exact equality of two output trees (tensors, ``None`` and plain leaves)."""
    from sglang_bcg_plugin.output.trees import flatten

    (na, la), (nb, lb) = flatten(a), flatten(b)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (_, x), (_, y) in zip(la, lb, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
