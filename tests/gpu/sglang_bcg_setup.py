"""SGLang's BCG engine (any release 0.5.13 to 0.5.23) on one GPU without a server: the stand-ins it needs, a decoder,
and the measurements (shared by ``sglang_gpu_driver.py`` and ``test_sglang_gpu.py``).

Releases 0.5.14+ run SGLang's ``BreakableCudaGraphBackend`` (the backend seam). 0.5.13 runs its
``BreakableCudaGraphRunner``'s own ``_capture_all`` / ``_capture_one`` (the runner seam) through
:class:`RunnerBackend`, with our hooks around them for ``ours`` and without them for
``builtin`` (one output per size, what 0.5.13 ships); the runner stand-ins are those of
``tests/sglang/seam_drivers.py``'s ``RunnerDriver`` (a model runner with ``server_args`` and a
one-rank group, the build-batch / metadata / forward calls routed to our decoder, a side stream
and a fresh graph pool for ``graph_capture``).

Stand-ins, and nothing else: a one-rank TP group (``get_parallel().override_permanently``)
whose ``barrier()`` synchronizes the device; a graph runner exposing ``model_runner`` (with
``server_args``), ``device_module`` (``torch.cuda``) and the row hooks
``cuda_graph_output_rows`` / ``cuda_graph_output_capacity_rows``; and the published
``ServerArgs`` (``set_global_server_args_for_scheduler``), which a capture session reads through
``get_exec()``. On ``--device cpu`` the CUDA graph primitive is also stood in
(``tests/sglang/cpu_graph_standin.py``) so the code path can be dry-run without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
SGLANG_TESTS = HERE.parent / "sglang"
ENV_SHARE = "SGLANG_ENABLE_BCG_SHARED_OUTPUT"
ENV_BUF = "SGLANG_BCG_SHARED_BUFFER"
ENV_GUARD = "SGLANG_BCG_STALE_OUTPUT_GUARD"


def import_sglang() -> None:
    """Import the SGLang modules used here, quietly (its import warnings are not ours)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            import torchvision  # noqa: F401
        except Exception:  # noqa: BLE001 - the bundle installs a stand-in where it is missing
            sys.path.insert(0, str(SGLANG_TESTS))
            import torchvision_standin

            torchvision_standin.install()
        import sglang.srt.layers.logits_processor  # noqa: F401
        import sglang.srt.server_args  # noqa: F401

def runner_seam() -> bool:
    """SGLang 0.5.13: the breakable graph is a runner (``BreakableCudaGraphRunner``)."""
    from sglang_bcg_plugin.sglang.compat import installed

    return installed().kind == "runner"


class RunnerBackend:
    """0.5.13's ``BreakableCudaGraphRunner`` behind the calls :class:`Setup` makes of a backend.

    ``capture_one`` only collects the forwards; the session's end runs the runner's real
    ``_capture_all`` over them (largest first, SGLang's two warmups per size, its segment engine).
    """

    def __init__(self, cuda: bool, hooked: bool) -> None:
        import pytest

        sys.path.insert(0, str(SGLANG_TESTS))
        from seam_drivers import RunnerDriver

        self.driver = RunnerDriver(pytest.MonkeyPatch(), cuda=cuda, hooked=hooked)
        self.hooked = hooked
        self._pending: dict[Any, Callable[[], Any]] = {}

    @contextlib.contextmanager
    def capture_session(self, stream: Any = None) -> Iterator[None]:
        self._pending = {}
        yield
        self.driver.capture(self._pending)

    def capture_one(self, key: Any, forward: Callable[[], Any], capture_inputs: Any = None) -> None:
        self._pending[self.driver.key(key.size)] = forward

    @contextlib.contextmanager
    def replay_session(self) -> Iterator[None]:
        yield

    def replay(self, key: Any, forward_batch: Any = None) -> Any:
        return self.driver.replay(self.driver.key(key.size))

    def memory_report(self) -> Any:
        return self.driver.report()

    @property
    def last_output_mode(self) -> Any:
        from sglang_bcg_plugin.sglang.runner_seam import runner_state

        return runner_state(self.driver.runner).resolution if self.hooked else None

    def cleanup(self) -> None:
        self.driver.cleanup()


class OneRankGroup:
    """What SGLang's BCG backend needs of the TP group: a ``barrier()`` (one rank: a sync)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def barrier(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


class Runner:
    """What SGLang's BCG backend reads from a graph runner (``base_cuda_graph_runner``)."""

    def __init__(self, server_args: Any, device_module: Any, device: str, rows: Callable[[Any], int | None] | None = None) -> None:
        # tp_group: where releases up to 0.5.21 read it (0.5.22+: get_parallel(), install_sglang)
        self.model_runner = SimpleNamespace(device=device, gpu_id=0, server_args=server_args, tp_group=OneRankGroup(device == "cuda"))
        self.device_module = device_module
        self.rows = rows

    def cuda_graph_output_rows(self, output: Any) -> int | None:
        return None if self.rows is None else self.rows(output)

    def cuda_graph_output_capacity_rows(self, output: Any) -> int | None:
        return None


def shape_key(size: int, stream_idx: int | None = None) -> Any:
    if runner_seam():  # 0.5.13 keys its graphs by the token count
        return SimpleNamespace(size=size, stream_idx=stream_idx)
    from sglang.srt.model_executor.runner.shape_key import ShapeKey

    return ShapeKey(size=size, stream_idx=stream_idx)  # the other fields differ per release


def install_sglang(cuda: bool, tp_size: int = 1) -> Any:
    """Publish ``ServerArgs`` (``--tp-size tp_size``), install the one-rank group; returns the
    ``ServerArgs`` (a caller with ``tp_size`` > 1 installs its own group over it)."""
    import_sglang()
    from sglang.srt import server_args as sa

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        server_args = sa.prepare_server_args(["--model-path", "dummy", "--tp-size", str(tp_size)])
    if hasattr(sa, "set_global_server_args_for_scheduler"):
        sa.set_global_server_args_for_scheduler(server_args)
    try:  # 0.5.22+ read the TP group from the runtime context; older ones from the runner
        from sglang.srt.runtime_context import get_parallel
    except ImportError:
        get_parallel = None
    parallel = get_parallel() if get_parallel is not None else None
    if hasattr(parallel, "override_permanently"):
        parallel.override_permanently(tp_group=OneRankGroup(cuda))
    if not cuda:  # the dry run: tests/sglang's CPU stand-ins (cpu_graph_standin's docstring)
        sys.path.insert(0, str(SGLANG_TESTS))
        from conftest import bcg_module
        from cpu_graph_standin import SegmentGraph

        torch.cuda.CUDAGraph = SegmentGraph  # type: ignore[misc,assignment]
        torch.cuda.current_stream = torch.cpu.current_stream  # type: ignore[assignment]
        engine = bcg_module()
        original = engine._weak_ref_if_tensor
        engine._weak_ref_if_tensor = lambda x: x if torch.is_tensor(x) and x.device.type == "cpu" else original(x)
    return server_args


def sglang_attention() -> Callable[..., None]:
    """The bench decoder's attention as an SGLang ``eager_on_graph`` break (RadixAttention-like:
    the output is allocated by the caller inside the segment, the break writes it)."""
    import importlib

    from sglang_bcg_plugin.bench.model import attention_op
    from sglang_bcg_plugin.sglang.compat import BACKEND_MODULE, RUNNER_MODULE, eager_break, installed

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, num_heads: int, num_kv_heads: int) -> None:
        attention_op(q, k, v, out, num_heads, num_kv_heads)

    seam = importlib.import_module(RUNNER_MODULE if runner_seam() else BACKEND_MODULE)
    engine = sys.modules[seam.BreakableCUDAGraphCapture.__module__]  # the segment engine's module
    return eager_break(engine, attention, installed().eager_form)


class Setup:
    """One process's model, inputs, capture stream and measurements."""

    @staticmethod
    def add_arguments(ap: argparse.ArgumentParser) -> None:
        ap.add_argument("--device", default="cuda")
        ap.add_argument("--hidden", type=int, default=2880)
        ap.add_argument("--layers", type=int, default=4)
        ap.add_argument("--heads", type=int, default=45)
        ap.add_argument("--kv-heads", type=int, default=5)
        ap.add_argument("--intermediate", type=int, default=2880)
        ap.add_argument("--dtype", default="bfloat16")
        ap.add_argument("--max-tokens", type=int, default=16384)
        ap.add_argument("--repeats", type=int, default=20)
        ap.add_argument("--cycles", type=int, default=10)

    @classmethod
    def from_args(cls, args: argparse.Namespace, *, needs_sglang: bool = True) -> Setup:
        return cls(vars(args), needs_sglang=needs_sglang)

    def __init__(self, opts: dict[str, Any], *, needs_sglang: bool = True) -> None:
        from sglang_bcg_plugin.bench.sizes import prefill_capture_sizes

        self.opts = opts
        self.device = str(opts["device"])
        self.cuda = self.device.startswith("cuda")
        self.repeats = int(opts["repeats"])
        self.sizes = sorted(prefill_capture_sizes(int(opts["max_tokens"])), reverse=True)
        if not needs_sglang:
            return
        self.server_args = self.install()
        self.model = self.make_model()
        self.x = self.make_input()
        self.stream = torch.cuda.Stream() if self.cuda else None
        with torch.no_grad(), self.on_stream():  # lazy kernels and cuBLAS workspaces first
            self.model(self.x)
            self.model(self.x[:4])
        with torch.no_grad():
            # The eager reference of max_error runs on the default stream: its cuBLAS workspace
            # (32 MiB per stream, kept for the process) is made here, before any baseline, or it
            # reads as 90 MiB of "drift" (its allocator segment) after the first check.
            self.model(self.x[:4])
        self.sync()

    def install(self) -> Any:
        """SGLang's published ``ServerArgs`` and TP group (:func:`install_sglang`)."""
        return install_sglang(self.cuda)

    def make_model(self) -> Any:
        """The synthetic decoder, its attention an SGLang ``eager_on_graph`` break."""
        from sglang_bcg_plugin.bench.model import SyntheticDecoder

        return SyntheticDecoder(self.decoder_config(), attention=sglang_attention())

    def make_input(self) -> torch.Tensor:
        """The static input at the largest size."""
        return torch.randn(self.sizes[0], int(self.opts["hidden"]), dtype=self.dtype, device=self.device)

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, str(self.opts["dtype"]))  # type: ignore[no-any-return]

    def decoder_config(self) -> Any:
        from sglang_bcg_plugin.bench.model import DecoderConfig

        o = self.opts
        return DecoderConfig(o["hidden"], o["layers"], o["heads"], o["kv_heads"], o["intermediate"], self.dtype, self.device)

    def device_module(self) -> Any:
        if self.cuda:
            return torch.cuda
        from cpu_graph_standin import FakeDeviceModule

        return FakeDeviceModule()

    def runner(self, rows: Callable[[Any], int | None] | None = None) -> Runner:
        runner = Runner(self.server_args, self.device_module(), self.device, rows)
        runner.capture_num_tokens = sorted(self.sizes)  # type: ignore[attr-defined]  # as SGLang's prefill runner: the schedule
        return runner

    def backend(self, kind: str, runner: Runner | None = None) -> Any:
        if runner_seam():
            return RunnerBackend(self.cuda, hooked=kind != "builtin")
        from sglang.srt.model_executor.runner_backend.breakable_cuda_graph_backend import BreakableCudaGraphBackend

        from sglang_bcg_plugin.sglang import sglang_breakable_backend_class

        cls = BreakableCudaGraphBackend if kind == "builtin" else sglang_breakable_backend_class()
        return cls(runner or self.runner(), enable_memory_saver=False, debug_eager=False)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    @contextlib.contextmanager
    def on_stream(self) -> Iterator[None]:
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            yield
        torch.cuda.current_stream().wait_stream(self.stream)

    def forward_for(self, size: int, *, keep: bool = True, output: str = "tensor") -> Callable[[], Any]:
        x = self.x[:size]

        def forward() -> Any:
            h = self.model(x)
            if not keep:
                return None  # the floor: the output is released inside its graph
            if output == "logits":
                from sglang.srt.layers.logits_processor import LogitsProcessorOutput

                return LogitsProcessorOutput(next_token_logits=h)
            return h

        return forward

    def capture(self, backend: Any, sizes: list[int], *, keep: bool = True, output: str = "tensor") -> None:
        """One capture session over ``sizes`` (largest first), on the capture stream, as
        SGLang's runners do (``graph_capture`` makes the capture stream current)."""
        from sglang_bcg_plugin.sglang.compat import installed

        # the static inputs, where the release's capture_one takes them (0.5.14-0.5.16 name that
        # parameter ``dummies``, and SGLang's own runners pass None there)
        inputs = self.x if installed().capture_inputs else None
        with torch.no_grad(), self.on_stream(), backend.capture_session(self.stream):
            for size in sizes:
                backend.capture_one(shape_key(size), self.forward_for(size, keep=keep, output=output), inputs)
        self.sync()

    def replay(self, backend: Any, size: int, stream_idx: int | None = None) -> Any:
        with backend.replay_session():
            return backend.replay(shape_key(size, stream_idx), None)

    def refill(self) -> None:
        self.x.copy_(torch.randn_like(self.x))

    def max_error(self, backend: Any, sizes: list[int], leaf: Callable[[Any], torch.Tensor]) -> float:
        worst = 0.0
        with torch.no_grad():
            for size in sizes:
                out = leaf(self.replay(backend, size)).clone()  # read before anything else replays
                ref = self.model(self.x[:size])
                worst = max(worst, float((out.float() - ref.float()).abs().max()))
        return worst

    def time_replay(self, backend: Any, size: int) -> float:
        for _ in range(3):
            self.replay(backend, size)
        self.sync()
        times = []
        for _ in range(self.repeats):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                self.replay(backend, size)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                self.replay(backend, size)
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def memory(self) -> dict[str, int]:
        gc.collect()
        if not self.cuda:
            return {"free": 0, "reserved": 0}
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return {"free": int(torch.cuda.mem_get_info()[0]), "reserved": int(torch.cuda.memory_reserved())}

    @staticmethod
    def memory_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
        return {"graph_bytes": before["free"] - after["free"], "reserved_bytes": after["reserved"] - before["reserved"]}

    def device_name(self) -> str:
        return torch.cuda.get_device_name(0) if self.cuda else "cpu"


def report_result(name: str, result: Any, jsonl: str, prefix: str) -> None:
    """One variant's result: a line appended to ``$SGLANG_BCG_GPU_RESULTS_DIR/<jsonl>`` as it
    ends (a run cut short still leaves what it measured), and a short line on stderr."""
    import json
    import os

    results_dir = os.environ.get("SGLANG_BCG_GPU_RESULTS_DIR")
    if results_dir:
        Path(results_dir).mkdir(parents=True, exist_ok=True)
        with Path(results_dir, jsonl).open("a") as f:
            f.write(json.dumps({name: result}) + "\n")
    print(f"{prefix}: {name}: {json.dumps(result)[:800]}", file=sys.stderr, flush=True)


def one_output_bytes(setup: Setup) -> int:
    """Bytes of one largest output (``max_tokens x hidden``)."""
    return int(setup.opts["max_tokens"]) * int(setup.opts["hidden"]) * torch.empty(0, dtype=setup.dtype).element_size()
