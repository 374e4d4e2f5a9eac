"""What the hooks and the forecast rely on, as protocols: the public surface of a backend and of the
registry a registration hook is given. :class:`~sglang_bcg_plugin.backends.base.CaptureBackend` and
:class:`~sglang_bcg_plugin.registry.BackendRegistry` implement them; naming the protocols here, below
both, keeps the hook specifications and the forecast from importing what imports them."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable
from typing import Any, Protocol

from .options import BackendOptions
from .output.report import MemoryReport


class BackendProtocol(Protocol):
    """A capture backend as hooks and the forecast see it (docs/index.md#backends)."""

    @property
    def name(self) -> str: ...
    @property
    def options(self) -> BackendOptions: ...
    @property
    def engine_name(self) -> str: ...
    def configure(self, **changes: Any) -> BackendOptions: ...
    def capture_session(self, stream: Any = None) -> contextlib.AbstractContextManager[None]: ...
    def size_context(self, size: int) -> contextlib.AbstractContextManager[None]: ...
    def capture_one(self, shape_key: Hashable, forward_fn: Callable[[], Any], capture_inputs: Any = None,
                    post_warmup_hook: Callable[[], None] | None = None) -> Any: ...
    def replay(self, shape_key: Hashable) -> Any: ...
    def captured_keys(self) -> list[Hashable]: ...
    def memory_report(self) -> MemoryReport: ...
    def cleanup(self) -> None: ...


class RegistryProtocol(Protocol):
    """What ``sglang_bcg_register_backends`` is given: ``add(name, factory)``, where
    ``factory(options=..., **kwargs)`` returns a backend."""

    def add(self, name: str, factory: Callable[..., Any]) -> None: ...
