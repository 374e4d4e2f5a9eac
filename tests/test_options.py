from __future__ import annotations

import pytest
import torch

from sglang_bcg_plugin import BackendOptions
from sglang_bcg_plugin._words import parse_bool_env


def _shares(*args: object, **kwargs: object) -> bool:
    """Sharing on (``on`` or ``released``)."""
    from sglang_bcg_plugin.output.mode import resolve_output_mode

    return resolve_output_mode(*args, **kwargs) != "off"  # type: ignore[arg-type]

ENV = "SGLANG_ENABLE_BCG_SHARED_OUTPUT"


@pytest.mark.parametrize("raw", ["1", "true", "TRUE", "Yes", "on", " On "])
def test_env_true(raw: str) -> None:
    assert _shares(environ={ENV: raw}) is True


@pytest.mark.parametrize("raw", ["0", "false", "False", "NO", "off"])
def test_env_false(raw: str) -> None:
    assert _shares(environ={ENV: raw}) is False


@pytest.mark.parametrize("raw", ["2", "maybe", "enable", "tru"])
def test_env_garbage_names_variable(raw: str) -> None:
    with pytest.raises(ValueError, match=ENV):
        _shares(environ={ENV: raw})


def test_unset_or_empty_is_default_false() -> None:
    assert _shares(environ={}) is False
    assert _shares(environ={ENV: ""}) is False
    assert parse_bool_env(ENV, {ENV: "  "}) is None


def test_precedence() -> None:
    from sglang_bcg_plugin.output.mode import Resolution

    def host_or(explicit: str | None, host: Resolution | None, environ: dict[str, str]) -> bool:
        """A host's resolution stands in for a missing explicit option."""
        return _shares(explicit if explicit is not None else host, environ=environ)

    on, off = Resolution("on", "host"), Resolution("off", "host")
    assert host_or("off", on, {ENV: "1"}) is False
    assert host_or(None, on, {ENV: "0"}) is True
    assert host_or(None, off, {ENV: "1"}) is False
    assert host_or(None, None, {ENV: "1"}) is True


def test_process_env_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "on")
    assert _shares() is True


def test_options_validation() -> None:
    assert BackendOptions().output_mode is None
    assert BackendOptions().strict_outputs is False
    with pytest.raises(ValueError, match="output_mode"):
        BackendOptions(output_mode="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="engine"):
        BackendOptions(engine="tpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_warmups"):
        BackendOptions(num_warmups=-1)
    with pytest.raises(TypeError, match="num_warmups"):
        BackendOptions(num_warmups=True)


def test_default_follows_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """``BackendOptions()`` follows the env var (one switch); standalone default is off."""
    from sglang_bcg_plugin import ShapeKey, create_backend

    assert BackendOptions().output_mode is None
    backend = create_backend("full", options=BackendOptions(engine="eager"))
    with backend.capture_session():
        assert backend.output_mode_active == "off"
    monkeypatch.setenv(ENV, "1")
    for options in (BackendOptions(engine="eager"), None):
        backend = create_backend("full", options=options)
        with backend.capture_session():
            assert backend.output_mode_active == "on"
            backend.capture_one(ShapeKey(2), lambda: torch.ones(2, 2))
    explicit = create_backend("full", options=BackendOptions(output_mode="off"))
    with explicit.capture_session():
        assert explicit.output_mode_active == "off"  # an explicit setting beats the env var


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"output_mode": "no"}, ValueError, "output_mode='no' is not an output mode; use one of 'off', 'on', 'released' or None"),
        ({"output_mode": 1}, TypeError, "output_mode .* got 1 of type int"),
        ({"strict_outputs": "no"}, TypeError, "strict_outputs must be True or False, got 'no' of type str"),
        ({"strict_outputs": None}, TypeError, "strict_outputs"),
        ({"stale_output_guard": 1}, TypeError, "stale_output_guard must be True or False, got 1 of type int"),
        ({"engine": 3}, TypeError, "engine must be 'auto', 'cuda' or 'eager', got 3 of type int"),
        ({"num_warmups": 2.0}, TypeError, "num_warmups must be an int >= 0, got 2.0 of type float"),
    ],
)
def test_every_field_is_type_checked(kwargs: dict[str, object], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        BackendOptions(**kwargs)  # type: ignore[arg-type]


def test_an_output_mode_string_that_is_no_mode_is_a_value_error() -> None:
    """``output_mode="shared"`` was a ``TypeError`` (for a string): a ``ValueError`` listing the
    modes, as for every other option value of the right type; a wrong type stays a ``TypeError``."""
    with pytest.raises(ValueError) as info:
        BackendOptions(output_mode="shared")  # type: ignore[arg-type]
    assert not isinstance(info.value, TypeError)
    assert str(info.value) == (
        "BackendOptions.output_mode='shared' is not an output mode; use one of 'off', 'on', 'released' or None "
        "(follow --enable-bcg-shared-output / SGLANG_ENABLE_BCG_SHARED_OUTPUT) (any case)"
    )
    with pytest.raises(ValueError, match="output_mode='xxx.*… \\(10000 characters\\)") as long:
        BackendOptions(output_mode="x" * 10_000)  # type: ignore[arg-type]
    assert len(str(long.value)) < 400  # the value is cut
    with pytest.raises(TypeError, match="got 2 of type int"):
        BackendOptions(output_mode=2)  # type: ignore[arg-type]


def test_create_backend_rejects_non_options() -> None:
    from sglang_bcg_plugin import create_backend

    with pytest.raises(TypeError, match=r"options must be a BackendOptions or None, got dict .*BackendOptions\(\.\.\.\)"):
        create_backend("full", options={"output_mode": "on"})  # type: ignore[arg-type]


def test_output_mode_is_normalised_and_replaceable() -> None:
    import dataclasses

    assert dataclasses.replace(BackendOptions(output_mode="on"), output_mode="released").output_mode == "released"
    assert BackendOptions(output_mode=" Released ").output_mode == "released"
    with pytest.raises(TypeError, match=r"got True of type bool \(use output_mode='on'\)"):
        BackendOptions(output_mode=True)  # type: ignore[arg-type]


def test_pool_reserve_option() -> None:
    assert BackendOptions().pool_reserve == "off"  # nothing changes until asked
    assert BackendOptions(pool_reserve=" AUTO ").pool_reserve == "auto"
    assert BackendOptions(pool_reserve=0).pool_reserve == "off"
    assert BackendOptions(pool_reserve=64 << 20).pool_reserve == 64 << 20
    for bad, exc in ((True, TypeError), (1.5, TypeError), (None, TypeError), (-1, ValueError), ("always", ValueError)):
        with pytest.raises(exc, match="BackendOptions.pool_reserve( must be|=.* is not a pool reserve; use one of) 'off', 'auto' or bytes"):
            BackendOptions(pool_reserve=bad)  # type: ignore[arg-type]


def test_pool_segments_option() -> None:
    assert BackendOptions().pool_segments == "fixed"  # nothing changes until asked
    assert BackendOptions(pool_segments=" Expandable ").pool_segments == "expandable"
    with pytest.raises(TypeError, match="BackendOptions.pool_segments must be 'fixed' or 'expandable', got None"):
        BackendOptions(pool_segments=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pool_segments='grow' is not a pool segment setting; use one of 'fixed' or 'expandable' \\(any case\\)"):
        BackendOptions(pool_segments="grow")  # type: ignore[arg-type]
