"""The output mode switch: values, precedence, and what each spelling resolves to."""

from __future__ import annotations

import pytest

from sglang_bcg_plugin import BackendOptions
from sglang_bcg_plugin.output_mode import (
    ACCEPTED_TEXT,
    check_share_output,
    explain_output_mode,
    mode_of_option,
    parse_mode_text,
    resolve_output_mode,
)


def _shares(*args: object, **kwargs: object) -> bool:
    """Sharing on (``on`` or ``released``): what the deprecated ``resolve_share_output`` said."""
    from sglang_bcg_plugin.output_mode import resolve_output_mode

    return resolve_output_mode(*args, **kwargs) != "off"  # type: ignore[arg-type]

ENV = "SGLANG_ENABLE_BCG_SHARED_OUTPUT"


@pytest.mark.parametrize(("raw", "mode"), [("1", "on"), ("ON", "on"), (" yes ", "on"), ("0", "off"), ("No", "off"),
                                           ("released", "released"), (" RELEASED\t", "released"), ("", None), ("  ", None)])
def test_text_spellings(raw: str, mode: str | None) -> None:
    assert parse_mode_text(raw) == mode
    assert resolve_output_mode(environ={ENV: raw}) == (mode or "off")
    assert _shares(environ={ENV: raw}) is (mode in ("on", "released"))


@pytest.mark.parametrize("raw", ["2", "release", "releasedd", "maybe"])
def test_bad_text_names_the_source_and_the_choices(raw: str) -> None:
    with pytest.raises(ValueError, match=rf"{ENV}=.*not an output mode.*1/0, true/false, yes/no, on/off.*released"):
        resolve_output_mode(environ={ENV: raw})
    assert "released" in ACCEPTED_TEXT


def test_option_values() -> None:
    assert [mode_of_option(v) for v in (None, True, False, "released")] == [None, "on", "off", "released"]
    assert [mode_of_option(v) for v in ("on", " OFF ", "Released")] == ["on", "off", "released"]
    assert BackendOptions(output_mode="released").share_output == "released"
    for bad in (1, 0.0, "yes", "share"):
        with pytest.raises(TypeError, match=r"BackendOptions\.output_mode must be 'off', 'on', 'released' or None"):
            BackendOptions(output_mode=bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="my_option must be"):
        check_share_output([], name="my_option")


def test_precedence_and_reasons() -> None:
    class Stash:
        def __init__(self, value: object) -> None:
            self._bcg_shared_output = value

    env = {ENV: "released"}
    assert explain_output_mode(True, server_args=Stash(False), environ=env).source == "BackendOptions.output_mode='on'"
    r = explain_output_mode(None, server_args=Stash("released"), environ={ENV: "0"})
    assert (r.mode, r.source) == ("released", "--enable-bcg-shared-output (server_args._bcg_shared_output='released')")
    assert explain_output_mode(None, server_args=Stash(False), environ=env).mode == "off"
    assert explain_output_mode(None, server_args=object(), environ=env).describe() == f"released ({ENV}='released')"
    d = explain_output_mode(None, environ={}, default="on", default_reason="default: SGLang shares")
    assert d.describe() == "on (default: SGLang shares)"
    assert resolve_output_mode(environ={}, default="released") == "released"
    for bad in ("", 3):
        with pytest.raises(ValueError, match=r"server_args\._bcg_shared_output=.*expected True, False or 'released'"):
            explain_output_mode(None, server_args=Stash(bad), environ={})
    with pytest.raises(ValueError, match="is not an output mode"):  # a stash string that parses badly
        explain_output_mode(None, server_args=Stash("maybe"), environ={})
    assert _shares("released", environ={}) is True


_UNSET = object()


def _explain(explicit: str | None, stash: object, env: str | None) -> tuple[str, str]:
    """The mode and reason for an explicit option, the server flag's stash (``_UNSET``: not
    set) and the environment variable (``None``: unset)."""

    class ServerArgs:
        pass

    server_args = ServerArgs()
    if stash is not _UNSET:
        setattr(server_args, "_bcg_shared_output", stash)  # noqa: B010 - the flag's private stash
    r = explain_output_mode(explicit, server_args=server_args, environ={} if env is None else {ENV: env})
    return r.mode, r.source


@pytest.mark.parametrize("explicit", [None, "off", "on", "released"])
@pytest.mark.parametrize("stash", [_UNSET, False, True, "released"])
@pytest.mark.parametrize("env", [None, "0", "1", "released"])
def test_precedence_pinned(explicit: str | None, stash: object, env: str | None) -> None:
    """Explicit option > the server flag's stash > the environment variable > the default,
    with the reason each one gives (quoted by ``sglang-bcg doctor`` and the docs)."""
    modes: dict[object, str] = {False: "off", True: "on", "released": "released", "0": "off", "1": "on"}
    if explicit is not None:
        expected = (explicit, f"BackendOptions.output_mode={explicit!r}")
    elif stash is not _UNSET:
        expected = (modes[stash], f"--enable-bcg-shared-output (server_args._bcg_shared_output={stash!r})")
    elif env is not None:
        expected = (modes[env], f"{ENV}={env!r}")
    else:
        expected = ("off", "default: off")
    assert _explain(explicit, stash, env) == expected
