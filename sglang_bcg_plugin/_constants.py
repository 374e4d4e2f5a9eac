"""Names shared by every module: the project name, the hook prefix, the env vars."""

from __future__ import annotations

#: Project name, pluggy project name and entry-point group for third-party backends.
NAME = "sglang_bcg"

#: Environment variable that selects the output mode: a boolean (sharing on / off) or
#: ``released`` (see :mod:`sglang_bcg_plugin.output_mode`).
ENV_SHARE_OUTPUT = "SGLANG_ENABLE_BCG_SHARED_OUTPUT"

#: Environment variable listing plugin names (comma separated) that must not be loaded.
ENV_BLOCK_PLUGINS = "SGLANG_BCG_BLOCK_PLUGINS"

#: Attribute on SGLang's ``ServerArgs`` that carries the parsed flag into spawned processes.
SERVER_ARGS_STASH = "_bcg_shared_output"

#: Environment variable that turns the stale-output guard on for the SGLang-integrated backend
#: (which keeps SGLang's constructor, so it has no ``BackendOptions``).
ENV_STALE_OUTPUT_GUARD = "SGLANG_BCG_STALE_OUTPUT_GUARD"

#: Environment variable that overrides where the SGLang-integrated backend's shared buffer
#: comes from (``adopt`` or ``reserve``); unset: ``reserve``. Our own backends take
#: ``BackendOptions(shared_buffer=...)``.
ENV_SHARED_BUFFER = "SGLANG_BCG_SHARED_BUFFER"
