"""Run one of our registered backends behind SGLang's ``BaseCudaGraphBackend`` interface.

Used when ``sglang_bcg_select_backend`` routes a phase to a registered backend that is not itself
an SGLang backend class (for example ``"full"`` or ``"piecewise"`` of this package, or a
third-party :class:`~sglang_bcg_plugin.CaptureBackend`). Such a backend captures with *our*
engines, so what that means inside SGLang:

* it is not an instance of SGLang's ``BreakableCudaGraphBackend``, so SGLang's prefill runner
  takes its non-breakable code paths (no static prefill buffers, no captured attention
  metadata); prefer routing the *decode* phase, or register a subclass of
  :func:`~sglang_bcg_plugin.integration.sglang_breakable_backend_class` for prefill;
* SGLang's ``eager_on_graph`` break points are not break points for our engines (they run
  inline and are captured); our engines break at :func:`sglang_bcg_plugin.graph_break`;
* the output mode follows the server flag / env var (``BackendOptions(output_mode=None)``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

from ..backends.base import CaptureBackend
from ..report import MemoryReport
from .compat import capture_one_args


class CaptureBackendAdapterMixin:
    """SGLang's six-method backend contract, forwarded to a :class:`CaptureBackend`."""

    def __init__(self, backend: CaptureBackend, cuda_graph_runner: object = None) -> None:
        self.backend = backend
        self._cuda_graph_runner = cuda_graph_runner

    @contextlib.contextmanager
    def capture_session(self, stream: Any) -> Iterator[None]:
        with self.backend.capture_session(stream):
            yield

    def capture_one(self, shape_key: Any, forward_fn: Callable[[], Any], *args: Any, **kwargs: Any) -> None:
        """``(capture_inputs, post_warmup_hook)`` under any release's names (``dummies`` up to 0.5.16)."""
        self.backend.capture_one(shape_key, forward_fn, *capture_one_args(args, kwargs))

    def can_run(self, forward_batch: Any, shape_key: Any) -> bool:
        return self.backend.can_run(shape_key)

    @contextlib.contextmanager
    def replay_session(self) -> Iterator[None]:
        yield

    def replay(self, shape_key: Any, static_forward_batch: Any, **kwargs: Any) -> Any:
        return self.backend.replay(shape_key)

    def cleanup(self) -> None:
        self.backend.cleanup()

    def memory_report(self) -> MemoryReport:
        return self.backend.memory_report()


@functools.cache
def sglang_adapter_class() -> type[Any]:
    """The adapter class: our mixin over SGLang's ``BaseCudaGraphBackend`` (built once)."""
    from sglang.srt.model_executor.runner_backend.base_cuda_graph_backend import BaseCudaGraphBackend

    return type(
        "CaptureBackendAdapter",
        (CaptureBackendAdapterMixin, BaseCudaGraphBackend),
        {"__module__": __name__, "__doc__": CaptureBackendAdapterMixin.__doc__},
    )
