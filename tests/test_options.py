from __future__ import annotations

import pytest

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
    assert BackendOptions().share_output is False
    assert BackendOptions().strict_outputs is False
    with pytest.raises(TypeError, match="share_output"):
        BackendOptions(share_output="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="engine"):
        BackendOptions(engine="tpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_warmups"):
        BackendOptions(num_warmups=-1)
    with pytest.raises(TypeError, match="num_warmups"):
        BackendOptions(num_warmups=True)
