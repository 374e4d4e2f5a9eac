"""The flag's stash, ``server_args._bcg_shared_output``, as an output-mode resolution.

``--enable-bcg-shared-output`` (:mod:`.flag`) stores ``True``, ``False`` or ``"released"`` on
SGLang's ``ServerArgs``. :func:`flag_resolution` turns that into the core's
:class:`~sglang_bcg_plugin.output_mode.Resolution` (the mode and its reason), which the
integration hands to the core's resolver as an explicit choice: ``explain_output_mode(
flag_resolution(server_args), ...)``, or ``CaptureBackend(output_mode=flag_resolution(...))``,
where an explicit ``BackendOptions(output_mode=...)`` still wins over it. So the precedence
stays: explicit option > the flag > ``SGLANG_ENABLE_BCG_SHARED_OUTPUT`` > the default.
"""

from __future__ import annotations

from ..output_mode import OFF, ON, OutputMode, Resolution, parse_mode_text
from ._names import SERVER_ARGS_STASH


def _mode_of_stash(stash: object) -> OutputMode:
    if isinstance(stash, bool):
        return ON if stash else OFF
    if isinstance(stash, str):
        mode = parse_mode_text(stash, what=f"server_args.{SERVER_ARGS_STASH}")
        if mode is not None:
            return mode
    msg = (
        f"server_args.{SERVER_ARGS_STASH}={stash!r} is not an output mode; expected True, "
        "False or 'released' (set by --enable-bcg-shared-output)"
    )
    raise ValueError(msg)


def flag_resolution(server_args: object | None) -> Resolution | None:
    """What ``--enable-bcg-shared-output`` chose for ``server_args`` (SGLang's ``ServerArgs``),
    with its reason; ``None`` when the flag was not given (no stash, or no ``server_args``).

    :raises ValueError: the stash is not ``True``, ``False`` or a mode.
    """
    stash = getattr(server_args, SERVER_ARGS_STASH, None) if server_args is not None else None
    if stash is None:
        return None
    return Resolution(_mode_of_stash(stash), f"--enable-bcg-shared-output (server_args.{SERVER_ARGS_STASH}={stash!r})")
