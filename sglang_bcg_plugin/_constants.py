"""Names shared by every module: the project name, the hook prefix, the core's env vars (the
SGLang integration's own: :mod:`sglang_bcg_plugin.sglang.compat`)."""

from __future__ import annotations

#: Project name, pluggy project name and entry-point group for third-party backends.
NAME = "sglang_bcg"

#: Environment variable that selects the output mode (:mod:`sglang_bcg_plugin.output.mode`), for every backend.
ENV_SHARE_OUTPUT = "SGLANG_ENABLE_BCG_SHARED_OUTPUT"

#: Environment variable listing plugin names (comma separated) that must not be loaded.
ENV_BLOCK_PLUGINS = "SGLANG_BCG_BLOCK_PLUGINS"
