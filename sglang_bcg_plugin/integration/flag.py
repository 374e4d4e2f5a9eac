"""``--enable-bcg-shared-output``: AFTER hooks on ``ServerArgs.add_cli_args`` / ``from_cli_args``.

``ServerArgs`` is a sealed msgspec Struct (a plugin cannot add a field, and ``from_cli_args``
drops unknown argparse attributes), so the parsed value travels two ways, both of which reach
spawned scheduler processes: the environment variable ``SGLANG_ENABLE_BCG_SHARED_OUTPUT``
(inherited) and the underscore attribute ``server_args._bcg_shared_output`` (survives pickling).
:func:`~sglang_bcg_plugin.resolve_share_output` reads the attribute, then the env var.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from .._constants import ENV_SHARE_OUTPUT, SERVER_ARGS_STASH

FLAG = "--enable-bcg-shared-output"
DEST = "enable_bcg_shared_output"

#: HookRegistry targets of the two AFTER hooks.
ADD_CLI_ARGS_TARGET = "sglang.srt.server_args.ServerArgs.add_cli_args"
FROM_CLI_ARGS_TARGET = "sglang.srt.server_args.ServerArgs.from_cli_args"

HELP = (
    "Share one breakable-CUDA-graph output buffer per stream across all capture sizes "
    "(sglang_bcg_plugin). --no-enable-bcg-shared-output turns it off. When neither is given, "
    f"the environment variable {ENV_SHARE_OUTPUT} decides (1/0; off when unset); Engine(...) "
    "users set that variable."
)


def after_add_cli_args(result: None, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
    """AFTER hook of the staticmethod ``ServerArgs.add_cli_args(parser)``: add the flag."""
    if FLAG in parser._option_string_actions:  # the same parser extended twice
        return None
    parser.add_argument(FLAG, dest=DEST, action=argparse.BooleanOptionalAction, default=None, help=HELP)
    return None


def after_from_cli_args(result: Any, cls: type, args: argparse.Namespace, *rest: Any, **kwargs: Any) -> Any:
    """AFTER hook of the classmethod ``ServerArgs.from_cli_args(args)``: carry the flag on.

    Not given (``None``): the environment is left alone, so ``SGLANG_ENABLE_BCG_SHARED_OUTPUT``
    set by the operator still decides.
    """
    value = getattr(args, DEST, None)
    if value is None:
        return result
    os.environ[ENV_SHARE_OUTPUT] = "1" if value else "0"
    setattr(result, SERVER_ARGS_STASH, bool(value))
    return result
