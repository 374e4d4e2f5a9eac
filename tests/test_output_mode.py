"""The output mode switch: values, precedence, and what each spelling resolves to."""

from __future__ import annotations

from typing import Any

import pytest

from sglang_bcg_plugin._constants import ENV_SHARE_OUTPUT
from sglang_bcg_plugin import BackendOptions, create_backend
from sglang_bcg_plugin.output.mode import (
    ACCEPTED_TEXT,
    Resolution,
    explain_output_mode,
    mode_of_option,
    parse_mode,
    resolve_output_mode,
)


def _shares(*args: object, **kwargs: object) -> bool:
    """Sharing on (``on`` or ``released``)."""
    from sglang_bcg_plugin.output.mode import resolve_output_mode

    return resolve_output_mode(*args, **kwargs) != "off"  # type: ignore[arg-type]

ENV = "SGLANG_ENABLE_BCG_SHARED_OUTPUT"


@pytest.mark.parametrize(("raw", "mode"), [("1", "on"), ("ON", "on"), (" yes ", "on"), ("0", "off"), ("No", "off"),
                                           ("released", "released"), (" RELEASED\t", "released"), ("", None), ("  ", None)])
def test_text_spellings(raw: str, mode: str | None) -> None:
    assert parse_mode(raw, ENV_SHARE_OUTPUT, text=True) == mode
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


def test_precedence_and_reasons() -> None:
    env = {ENV: "released"}
    assert explain_output_mode("on", environ=env).source == "BackendOptions.output_mode='on'"
    host = Resolution("off", "a host's choice")
    assert explain_output_mode(host, environ=env) is host
    assert explain_output_mode(None, environ=env).describe() == f"released ({ENV}='released')"
    d = explain_output_mode(None, environ={}, default="on", default_reason="default: SGLang shares")
    assert d.describe() == "on (default: SGLang shares)"
    assert resolve_output_mode(environ={}, default="released") == "released"
    assert resolve_output_mode(Resolution("on", "a host's choice"), environ=env) == "on"
    with pytest.raises(ValueError, match=r"Resolution\.mode must be one of 'off', 'on', 'released', got 'ON'"):
        Resolution(NOT_A_MODE, "not lowercase")
    assert _shares("released", environ={}) is True


ROUTES = ("resolver", "backend")


def _explain(route: str, explicit: str | None, host: str | None, env: str | None, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    """The mode and reason for an explicit option, a host's resolution (``None``: none) and the
    environment variable (``None``: unset), by one of :data:`ROUTES`: the core's resolver, or a
    backend's capture session."""
    environ = {} if env is None else {ENV: env}
    resolution = None if host is None else Resolution(host, "a host's choice")  # type: ignore[arg-type]
    if route == "resolver":  # a host's resolution stands in for a missing option
        r = explain_output_mode(explicit if explicit is not None else resolution, environ=environ)
    else:
        monkeypatch.delenv(ENV, raising=False)
        for name, value in environ.items():
            monkeypatch.setenv(name, value)
        options = BackendOptions(output_mode=explicit, engine="eager")
        backend = create_backend("full", options=options, output_mode=resolution)
        with backend.capture_session():
            assert backend.last_output_mode is not None
            r = backend.last_output_mode
    return r.mode, r.source


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("explicit", [None, "off", "on", "released"])
@pytest.mark.parametrize("host", [None, "off", "on", "released"])
@pytest.mark.parametrize("env", [None, "0", "1", "released"])
def test_precedence_pinned(route: str, explicit: str | None, host: str | None, env: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Explicit option > a host's resolution > the environment variable (which SGLang's flag
    sets) > the default, with the reason each one gives (quoted by ``sglang-bcg doctor``)."""
    modes = {"released": "released", "0": "off", "1": "on"}
    if explicit is not None:
        expected = (explicit, f"BackendOptions.output_mode={explicit!r}")
    elif host is not None:
        expected = (host, "a host's choice")
    elif env is not None:
        expected = (modes[env], f"{ENV}={env!r}")
    else:
        expected = ("off", "default: off")
    assert _explain(route, explicit, host, env, monkeypatch) == expected
