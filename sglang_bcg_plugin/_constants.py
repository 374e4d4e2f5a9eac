"""Names shared by every module: the project name, the hook prefix, the core's env vars.

Names only the SGLang integration reads (its own env vars)
live in :mod:`sglang_bcg_plugin.integration._names`.
"""

from __future__ import annotations

#: Project name, pluggy project name and entry-point group for third-party backends.
NAME = "sglang_bcg"

#: Environment variable that selects the output mode: a boolean (sharing on / off) or
#: ``released`` (see :mod:`sglang_bcg_plugin.output_mode`). Named for SGLang, but it is the core's
#: public switch: our standalone backends honour it too, so it lives here, not in the integration.
ENV_SHARE_OUTPUT = "SGLANG_ENABLE_BCG_SHARED_OUTPUT"

#: Environment variable listing plugin names (comma separated) that must not be loaded.
ENV_BLOCK_PLUGINS = "SGLANG_BCG_BLOCK_PLUGINS"
