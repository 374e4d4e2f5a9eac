from __future__ import annotations

import dataclasses

import pytest

from sglang_bcg_plugin import ShapeKey
from sglang_bcg_plugin.backends.base import check_key


def test_defaults_frozen_hashable() -> None:
    k = ShapeKey(8)
    assert (k.size, k.stream_idx, k.variant_label) == (8, None, None)
    assert hash(k) == hash(ShapeKey(8))
    assert k != ShapeKey(8, 0) and k != ShapeKey(8, None, "spec")
    with pytest.raises(dataclasses.FrozenInstanceError):
        k.size = 4  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "exc", "field"),
    [
        ({"size": 0}, ValueError, "size"),
        ({"size": -3}, ValueError, "size"),
        ({"size": True}, TypeError, "size"),
        ({"size": 2.0}, TypeError, "size"),
        ({"size": "8"}, TypeError, "size"),
        ({"size": 8, "stream_idx": -1}, ValueError, "stream_idx"),
        ({"size": 8, "stream_idx": False}, TypeError, "stream_idx"),
        ({"size": 8, "stream_idx": 1.5}, TypeError, "stream_idx"),
        ({"size": 8, "variant_label": ""}, ValueError, "variant_label"),
        ({"size": 8, "variant_label": 3}, TypeError, "variant_label"),
    ],
)
def test_validation_names_field_and_value(kwargs: dict[str, object], exc: type[Exception], field: str) -> None:
    with pytest.raises(exc) as info:
        ShapeKey(**kwargs)  # type: ignore[arg-type]
    assert f"ShapeKey.{field}" in str(info.value)
    assert repr(kwargs[field]) in str(info.value)


def test_check_key_accepts_foreign_keys() -> None:
    @dataclasses.dataclass(frozen=True)
    class FourField:
        size: int
        stream_idx: int | None = None
        variant_label: str | None = None
        attention_variant: str | None = None

    a, b = FourField(8, attention_variant="x"), FourField(8, attention_variant="y")
    assert check_key(a) is a and a != b


@pytest.mark.parametrize("bad", [object(), 8, (8, 0)])
def test_check_key_rejects_keys_without_fields(bad: object) -> None:
    with pytest.raises(TypeError, match="needs 'size' and 'stream_idx'"):
        check_key(bad)


def test_check_key_rejects_bad_size_and_unhashable() -> None:
    class K:
        stream_idx = None

        def __init__(self, size: object) -> None:
            self.size = size

    with pytest.raises(ValueError, match="expected an int >= 1"):
        check_key(K(0))

    class U(K):
        __hash__ = None  # type: ignore[assignment]

    with pytest.raises(TypeError, match="not hashable"):
        check_key(U(4))
