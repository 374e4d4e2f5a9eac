"""Names shared by every module: the project name, the hook prefix, the env var."""

from __future__ import annotations

#: Project name, pluggy project name and entry-point group for third-party backends.
NAME = "sglang_bcg"

#: Environment variable that switches output sharing on or off (see ``resolve_share_output``).
ENV_SHARE_OUTPUT = "SGLANG_ENABLE_BCG_SHARED_OUTPUT"

#: Environment variable listing plugin names (comma separated) that must not be loaded.
ENV_BLOCK_PLUGINS = "SGLANG_BCG_BLOCK_PLUGINS"

#: Attribute on SGLang's ``ServerArgs`` that carries the parsed flag into spawned processes.
SERVER_ARGS_STASH = "_bcg_shared_output"
