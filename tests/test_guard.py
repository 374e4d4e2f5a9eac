"""Stale-output guard on CPU.

torch's CPU build lacks ``torch._C._set_storage_access_error_msg`` (the CUDA build has it), so
the poison primitive is stood in by a recorder here; ``tests/gpu/test_guard_gpu.py`` checks the
real one raises on the H200. Everything else (fresh aliasing storages, which views are poisoned,
the message) is the real code.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from _support import make_backend
from sglang_bcg_plugin import ShapeKey
from sglang_bcg_plugin.output.guard import guard_supported


def _capture(backend: Any, xs: dict[ShapeKey, torch.Tensor]) -> None:
    with backend.capture_session():
        for key, x in xs.items():
            backend.capture_one(key, lambda x=x: x * 2, capture_inputs=x)


def test_guard_unsupported_warns_and_is_a_no_op(backend_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch._C, "_set_storage_access_error_msg", raising=False)
    assert not guard_supported()
    backend = make_backend(backend_name, share=True, stale_output_guard=True)
    xs = {ShapeKey(8): torch.randn(8, 2), ShapeKey(4): torch.randn(4, 2)}
    with pytest.warns(RuntimeWarning, match="cannot poison storages"):
        _capture(backend, xs)
    a = backend.replay(ShapeKey(8))
    b = backend.replay(ShapeKey(4))
    # no guard: the stale view of key 8 reads on, and shows key 4's rows (one shared buffer)
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    torch.testing.assert_close(a[:4], xs[ShapeKey(4)] * 2)


def test_guard_poisons_previous_other_key(backend_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    poisoned: list[tuple[int, str]] = []
    monkeypatch.setattr(torch._C, "_set_storage_access_error_msg", lambda t, msg: poisoned.append((id(t), msg)), raising=False)
    assert guard_supported()
    backend = make_backend(backend_name, share=True, stale_output_guard=True)
    xs = {ShapeKey(8): torch.randn(8, 2), ShapeKey(4): torch.randn(4, 2), ShapeKey(8, 1): torch.randn(8, 2)}
    _capture(backend, xs)
    a1 = backend.replay(ShapeKey(8))
    a2 = backend.replay(ShapeKey(8))  # same key again: nothing poisoned
    assert poisoned == []
    torch.testing.assert_close(a1, xs[ShapeKey(8)] * 2)
    other = backend.replay(ShapeKey(8, 1))  # another partition: nothing poisoned
    assert poisoned == [] and other.untyped_storage().data_ptr() != a1.untyped_storage().data_ptr()
    b = backend.replay(ShapeKey(4))
    assert [p[0] for p in poisoned] == [id(a2)]
    assert "replay(ShapeKey(size=8" in poisoned[0][1] and "replay(ShapeKey(size=4" in poisoned[0][1]
    # handed-out views alias the graph's memory through fresh storage objects
    assert b.untyped_storage().data_ptr() == a1.untyped_storage().data_ptr()
    assert b.untyped_storage() is not a1.untyped_storage()
    torch.testing.assert_close(b, xs[ShapeKey(4)] * 2)
    backend.cleanup()


def test_guard_off_returns_graph_output_itself(backend_name: str) -> None:
    backend = make_backend(backend_name, share=True)
    xs = {ShapeKey(8): torch.randn(8, 2)}
    _capture(backend, xs)
    assert backend.replay(ShapeKey(8)) is backend.replay(ShapeKey(8))


def _capture_dict(backend: Any) -> dict[str, torch.Tensor]:
    inputs = {"x": torch.randn(8, 2)}
    with backend.capture_session():
        backend.capture_one(ShapeKey(8), lambda: inputs["x"] * 2, capture_inputs=inputs)
    return inputs


@pytest.mark.parametrize("share", [False, True])
def test_debug_check_inputs_passes_in_place_updates(backend_name: str, share: bool) -> None:
    backend = make_backend(backend_name, share=share, debug_check_inputs=True)
    inputs = _capture_dict(backend)
    inputs["x"].copy_(torch.randn(8, 2))  # new values, same storage: what a runner does
    torch.testing.assert_close(backend.replay(ShapeKey(8)), inputs["x"] * 2)


@pytest.mark.parametrize("how", ["replaced", "data", "removed"])
def test_debug_check_inputs_raises_on_a_moved_input(backend_name: str, how: str) -> None:
    backend = make_backend(backend_name, share=False, debug_check_inputs=True)
    inputs = _capture_dict(backend)
    if how == "replaced":  # capture_inputs now points to a rebuilt tensor
        inputs["x"] = torch.randn(8, 2)
    elif how == "data":  # the same tensor object, its data moved
        inputs["x"].data = torch.randn(8, 2)
    else:
        del inputs["x"]
    with pytest.raises(RuntimeError, match=r"replay\(ShapeKey\(size=8.*static input capture_inputs\['x'\]"):
        backend.replay(ShapeKey(8))


def test_debug_check_inputs_is_off_by_default(backend_name: str) -> None:
    backend = make_backend(backend_name, share=False)
    inputs = _capture_dict(backend)
    inputs["x"] = torch.randn(8, 2)
    backend.replay(ShapeKey(8))  # no check: the graph would read the old address unnoticed
    with pytest.raises(TypeError, match="debug_check_inputs must be True or False"):
        make_backend(backend_name, share=False, debug_check_inputs=1)
