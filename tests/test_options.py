from __future__ import annotations

import pytest
import torch

from sglang_bcg_plugin import BackendOptions, resolve_share_output
from sglang_bcg_plugin.options import parse_bool_env

ENV = "SGLANG_ENABLE_BCG_SHARED_OUTPUT"


@pytest.mark.parametrize("raw", ["1", "true", "TRUE", "Yes", "on", " On "])
def test_env_true(raw: str) -> None:
    assert resolve_share_output(environ={ENV: raw}) is True


@pytest.mark.parametrize("raw", ["0", "false", "False", "NO", "off"])
def test_env_false(raw: str) -> None:
    assert resolve_share_output(environ={ENV: raw}) is False


@pytest.mark.parametrize("raw", ["2", "maybe", "enable", "tru"])
def test_env_garbage_names_variable(raw: str) -> None:
    with pytest.raises(ValueError, match=ENV):
        resolve_share_output(environ={ENV: raw})


def test_unset_or_empty_is_default_false() -> None:
    assert resolve_share_output(environ={}) is False
    assert resolve_share_output(environ={ENV: ""}) is False
    assert parse_bool_env(ENV, {ENV: "  "}) is None


def test_precedence() -> None:
    class Args:
        _bcg_shared_output = True

    class Off:
        _bcg_shared_output = False

    env_off = {ENV: "0"}
    assert resolve_share_output(False, server_args=Args(), environ={ENV: "1"}) is False
    assert resolve_share_output(None, server_args=Args(), environ=env_off) is True
    assert resolve_share_output(None, server_args=Off(), environ={ENV: "1"}) is False
    assert resolve_share_output(None, server_args=object(), environ={ENV: "1"}) is True


def test_process_env_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "on")
    assert resolve_share_output() is True


def test_options_validation() -> None:
    assert BackendOptions().share_output is None
    assert BackendOptions().strict_outputs is False
    with pytest.raises(TypeError, match="share_output"):
        BackendOptions(share_output="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="engine"):
        BackendOptions(engine="tpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_warmups"):
        BackendOptions(num_warmups=-1)
    with pytest.raises(TypeError, match="num_warmups"):
        BackendOptions(num_warmups=True)


def test_default_follows_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """``BackendOptions()`` follows the env var (one switch); standalone default is off."""
    from sglang_bcg_plugin import ShapeKey, create_backend

    assert BackendOptions().share_output is None
    backend = create_backend("full", options=BackendOptions(engine="eager"))
    with backend.capture_session():
        assert backend.share_output_active is False
    monkeypatch.setenv(ENV, "1")
    for options in (BackendOptions(engine="eager"), None):
        backend = create_backend("full", options=options)
        with backend.capture_session():
            assert backend.share_output_active is True
            backend.capture_one(ShapeKey(2), lambda: torch.ones(2, 2))
    explicit = create_backend("full", options=BackendOptions(share_output=False))
    with explicit.capture_session():
        assert explicit.share_output_active is False  # an explicit setting beats the env var


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"share_output": "no"}, TypeError, "share_output must be True, False or None.*'no' of type str"),
        ({"share_output": 1}, TypeError, "share_output .* got 1 of type int"),
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


def test_create_backend_rejects_non_options() -> None:
    from sglang_bcg_plugin import create_backend

    with pytest.raises(TypeError, match=r"options must be a BackendOptions or None, got dict .*BackendOptions\(\.\.\.\)"):
        create_backend("full", options={"share_output": True})  # type: ignore[arg-type]
