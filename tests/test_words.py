"""The one parser of a switch's word (``_words.parse_word``): every option, variable and flag value."""

from __future__ import annotations

import pytest

from sglang_bcg_plugin._constants import ENV_SHARE_OUTPUT
from sglang_bcg_plugin import BackendOptions
from sglang_bcg_plugin._words import BOOLEAN, BOOLEAN_TEXT, parse_bool_env, parse_env, parse_word
from sglang_bcg_plugin.sglang.forecast_log import forecast_enabled
from sglang_bcg_plugin.sglang.sglang_session import shared_buffer
from sglang_bcg_plugin.output.mode import parse_mode

WORDS = {"adopt": "adopt", "reserve": "reserve"}


@pytest.mark.parametrize(("raw", "value"), [("adopt", "adopt"), ("ADOPT", "adopt"), (" Reserve\t", "reserve")])
def test_any_case_and_surrounding_whitespace(raw: str, value: str) -> None:
    assert parse_word(raw, WORDS, "X", kind="a buffer source") == value


def test_a_word_that_is_not_accepted_names_the_switch_and_lists_the_choices() -> None:
    with pytest.raises(ValueError, match=r"^X='pool' is not a buffer source; use one of 'adopt' or 'reserve' \(any case\)$"):
        parse_word("pool", WORDS, "X", kind="a buffer source")
    with pytest.raises(ValueError, match=r"^X='' is not a boolean; use one of 1/0, true/false, yes/no, on/off \(any case\)$"):
        parse_word("", BOOLEAN, "X", kind="a boolean", accepted=BOOLEAN_TEXT)
    with pytest.raises(ValueError) as long:
        parse_word("y" * 100_000, WORDS, "X", kind="a buffer source")
    assert "X='" + "y" * 80 + "'… (100000 characters) is not" in str(long.value) and len(str(long.value)) < 300


def test_a_value_that_is_not_a_str_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"^X must be 'adopt' or 'reserve', got 1 of type int$"):
        parse_word(1, WORDS, "X", kind="a buffer source")


@pytest.mark.parametrize(("raw", "value"), [*((w, v) for w, v in BOOLEAN.items()), (" TRUE ", True), ("Off", False), ("", None), ("  ", None)])
def test_booleans(raw: str, value: bool | None) -> None:
    assert parse_bool_env("FLAG", {"FLAG": raw}) is value
    assert forecast_enabled({"SGLANG_BCG_FORECAST": raw}) is bool(value)


def test_unset_is_none_and_each_caller_says_its_default() -> None:
    assert parse_env("FLAG", WORDS, kind="a buffer source", environ={}) is None
    assert parse_bool_env("FLAG", {}) is None
    assert shared_buffer({}) == "reserve" and shared_buffer({"SGLANG_BCG_SHARED_BUFFER": " "}) == "reserve"
    assert parse_mode(None, ENV_SHARE_OUTPUT, text=True) is None and parse_mode(" ", ENV_SHARE_OUTPUT, text=True) is None


def test_every_caller_takes_the_same_spelling() -> None:
    """The option, the integration's variable and the mode's text read words alike."""
    assert shared_buffer({"SGLANG_BCG_SHARED_BUFFER": "ADOPT"}) == "adopt"
    assert BackendOptions(shared_buffer="ADOPT").shared_buffer == "adopt"  # type: ignore[arg-type]
    assert BackendOptions(engine=" Eager ").engine == "eager"  # type: ignore[arg-type]
    assert parse_mode(" Yes ", ENV_SHARE_OUTPUT, text=True) == "on" and parse_mode("RELEASED", ENV_SHARE_OUTPUT, text=True) == "released"


@pytest.mark.parametrize(("call", "match"), [
    (lambda: parse_bool_env("SGLANG_BCG_STALE_OUTPUT_GUARD", {"SGLANG_BCG_STALE_OUTPUT_GUARD": "maybe"}),
     r"SGLANG_BCG_STALE_OUTPUT_GUARD='maybe' is not a boolean; use one of 1/0, true/false, yes/no, on/off"),
    (lambda: forecast_enabled({"SGLANG_BCG_FORECAST": "tru"}),
     r"SGLANG_BCG_FORECAST='tru' is not a boolean; use one of 1/0, true/false, yes/no, on/off"),
    (lambda: shared_buffer({"SGLANG_BCG_SHARED_BUFFER": "auto"}),
     r"SGLANG_BCG_SHARED_BUFFER='auto' is not a buffer source; use one of 'adopt' or 'reserve', or unset it"),
    (lambda: parse_mode("maybe", ENV_SHARE_OUTPUT, text=True),
     r"SGLANG_ENABLE_BCG_SHARED_OUTPUT='maybe' is not an output mode; use one of 1/0, .* or released"),
])
def test_every_caller_names_its_variable_and_the_accepted_values(call: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()  # type: ignore[operator]


def test_doctor_says_a_forecast_variable_is_invalid() -> None:
    from sglang_bcg_plugin.sglang.doctor import forecast_line

    assert forecast_line("backend", {"SGLANG_BCG_FORECAST": "tru"}).startswith("invalid (SGLANG_BCG_FORECAST='tru' is not a boolean")
