"""``--enable-bcg-shared-output[=on|off|released]`` / ``--no-enable-bcg-shared-output`` (the last
wins), written to ``SGLANG_ENABLE_BCG_SHARED_OUTPUT`` at launch (docs/sglang.md)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from .._constants import ENV_SHARE_OUTPUT
from .._words import parse_bool_env
from ..output.mode import OFF, ON, RELEASED, OutputMode, parse_mode
from .compat import ENV_STALE_OUTPUT_GUARD
from .incremental import incremental_enabled
from .memory_plan import check_environment
from .sglang_session import session_switches

FLAG = "--enable-bcg-shared-output"
NO_FLAG = "--no-enable-bcg-shared-output"
DEST = "enable_bcg_shared_output"

ADD_CLI_ARGS_TARGET = "sglang.srt.server_args.ServerArgs.add_cli_args"
FROM_CLI_ARGS_TARGET = "sglang.srt.server_args.ServerArgs.from_cli_args"

HELP = ("Output mode of breakable CUDA graphs (sglang_bcg_plugin). Bare or =on: share one output buffer per stream "
        "across all capture sizes; =released: zero-copy outputs that live in graph-pool memory until any other graph "
        "of the pool replays (opt-in; read the plugin's docs first); =off or --no-enable-bcg-shared-output: one "
        f"output per size. When neither is given, {ENV_SHARE_OUTPUT} decides (1/0/released), else the installed "
        "SGLang's own default (0.5.14+: on; 0.5.13: off). Engine(...) users set that variable.")

#: Each mode as the variable's text.
ENV_TEXT: dict[OutputMode, str] = {ON: "1", OFF: "0", RELEASED: RELEASED}


class OutputModeAction(argparse.Action):
    """``--enable-bcg-shared-output[=MODE]`` (``nargs="?"``): a bare flag means ``on``."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        try:
            mode = parse_mode(values, FLAG, text=True)
        except ValueError as exc:
            parser.error(f"{exc} (give the mode as {FLAG}=MODE)")
        setattr(namespace, self.dest, ON if mode is None else mode)


def after_add_cli_args(result: None, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
    """AFTER hook of the staticmethod ``ServerArgs.add_cli_args(parser)``: add the flag."""
    if FLAG in parser._option_string_actions:  # the same parser extended twice
        return None
    parser.add_argument(FLAG, dest=DEST, action=OutputModeAction, nargs="?", metavar="{on,off,released}", default=None,
                        help=HELP)
    parser.add_argument(NO_FLAG, dest=DEST, action="store_const", const=OFF, help=f"Same as {FLAG}=off.")


def after_from_cli_args(result: Any, cls: type, args: argparse.Namespace, *rest: Any, **kwargs: Any) -> Any:
    """AFTER hook of the classmethod ``ServerArgs.from_cli_args(args)``: the flag, when given, to
    ``SGLANG_ENABLE_BCG_SHARED_OUTPUT``; then, when a mode or the guard is asked, whether the release
    can serve it (:func:`.sglang_session.session_switches`). :raises SystemExit: it cannot, in one line."""
    env = os.environ
    if (value := getattr(args, DEST, None)) is not None:
        env[ENV_SHARE_OUTPUT] = ENV_TEXT[value]
    try:
        check_environment(env)
        incremental_enabled(env)
        if (env.get(ENV_SHARE_OUTPUT) or "").strip() or parse_bool_env(ENV_STALE_OUTPUT_GUARD, env):
            session_switches(env)
    except ValueError as exc:
        raise SystemExit(f"sglang_bcg: {exc}") from None
    return result
