"""The output mode switch: values, precedence, and what each spelling resolves to."""

from __future__ import annotations

from typing import Any

import pytest

from sglang_bcg_plugin import BackendOptions, create_backend
from sglang_bcg_plugin.integration import flag_resolution
from sglang_bcg_plugin.output_mode import (
    ACCEPTED_TEXT,
    Resolution,
    explain_output_mode,
    mode_of_option,
    parse_mode_text,
    resolve_output_mode,
)


def _shares(*args: object, **kwargs: object) -> bool:
    """Sharing on (``on`` or ``released``)."""
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
    for bad in (1, 0.0, "yes", "share"):
        error = ValueError if isinstance(bad, str) else TypeError  # a string that is no mode: a ValueError
        with pytest.raises(error, match=r"BackendOptions\.output_mode(=.* is not an output mode; use one of| must be) 'off', 'on', 'released' or None"):
            BackendOptions(output_mode=bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"BackendOptions\.output_mode must be .*, got True of type bool \(use output_mode='on'\)"):
        BackendOptions(output_mode=True)  # type: ignore[arg-type]


NOT_A_MODE: Any = "ON"


class Stash:
    """A stand-in for SGLang's ``ServerArgs`` carrying the flag's stash."""

    def __init__(self, value: object) -> None:
        self._bcg_shared_output = value


def test_precedence_and_reasons() -> None:
    env = {ENV: "released"}
    assert explain_output_mode("on", environ=env).source == "BackendOptions.output_mode='on'"
    r = explain_output_mode(flag_resolution(Stash("released")), environ={ENV: "0"})
    assert (r.mode, r.source) == ("released", "--enable-bcg-shared-output (server_args._bcg_shared_output='released')")
    assert explain_output_mode(flag_resolution(Stash(False)), environ=env).mode == "off"
    assert flag_resolution(object()) is None and flag_resolution(None) is None
    assert explain_output_mode(flag_resolution(object()), environ=env).describe() == f"released ({ENV}='released')"
    d = explain_output_mode(None, environ={}, default="on", default_reason="default: SGLang shares")
    assert d.describe() == "on (default: SGLang shares)"
    assert resolve_output_mode(environ={}, default="released") == "released"
    assert resolve_output_mode(Resolution("on", "a host's choice"), environ=env) == "on"
    for bad in ("", 3):
        with pytest.raises(ValueError, match=r"server_args\._bcg_shared_output=.*expected True, False or 'released'"):
            flag_resolution(Stash(bad))
    with pytest.raises(ValueError, match="is not an output mode"):  # a stash string that parses badly
        flag_resolution(Stash("maybe"))
    with pytest.raises(ValueError, match=r"Resolution\.mode must be one of 'off', 'on', 'released', got 'ON'"):
        Resolution(NOT_A_MODE, "not lowercase")
    assert _shares("released", environ={}) is True


_UNSET = object()
ROUTES = ("resolver", "backend")


def _server_args(stash: object) -> object:
    class ServerArgs:
        pass

    server_args = ServerArgs()
    if stash is not _UNSET:
        setattr(server_args, "_bcg_shared_output", stash)  # noqa: B010 - the flag's private stash
    return server_args


def _explain(route: str, explicit: str | None, stash: object, env: str | None, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    """The mode and reason for an explicit option, the server flag's stash (``_UNSET``: not
    set) and the environment variable (``None``: unset), by one of :data:`ROUTES`: the
    integration's resolution handed to the core's resolver or to a backend."""
    server_args = _server_args(stash)
    environ = {} if env is None else {ENV: env}
    if route == "resolver":  # what the integration does: the flag stands in for a missing option
        r = explain_output_mode(explicit if explicit is not None else flag_resolution(server_args), environ=environ)
    else:
        monkeypatch.delenv(ENV, raising=False)
        for name, value in environ.items():
            monkeypatch.setenv(name, value)
        options = BackendOptions(output_mode=explicit, engine="eager")
        backend = create_backend("full", options=options, output_mode=flag_resolution(server_args))
        with backend.capture_session():
            assert backend.last_output_mode is not None
            r = backend.last_output_mode
    return r.mode, r.source


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("explicit", [None, "off", "on", "released"])
@pytest.mark.parametrize("stash", [_UNSET, False, True, "released"])
@pytest.mark.parametrize("env", [None, "0", "1", "released"])
def test_precedence_pinned(route: str, explicit: str | None, stash: object, env: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
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
    assert _explain(route, explicit, stash, env, monkeypatch) == expected
