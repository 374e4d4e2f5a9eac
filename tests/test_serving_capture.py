"""A capture while the server serves writes its dummy KV into the padding slot (sglang/serving_capture.py).

Stood in: SGLang's runner classes (their ``capture_prepare`` builds the capture batch over the static input
buffers, where the last replay left live KV slots): :class:`Prefill` and :class:`Decode` return a batch whose
``out_cache_loc`` views such a buffer, as the prefill (``(batch, attn_backend)``) and decode (``(batch,
attn_backend, pp_proxy)``) runners of 0.5.14-0.5.23 do. tests/sglang/test_serving_capture.py checks the real
classes have that member and build the batch from the static slot."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace as NS
from typing import Any

import pytest
import torch

from sglang_bcg_plugin.sglang import serving_capture as sc


class Prefill:
    def __init__(self) -> None:
        self.static = torch.tensor([17, 18, 19, 40, 41])  # the last replay's KV slots, requests still in flight

    def capture_prepare(self, num_tokens: int) -> tuple[Any, Any]:
        return NS(out_cache_loc=self.static[:num_tokens]), "attn"


class Decode(Prefill):
    def capture_prepare(self, size: int, stream_idx: int | None = None, num_tokens: int | None = None) -> Any:
        return NS(out_cache_loc=self.static[:size]), "attn", None


class Bare:
    def capture_prepare(self, num_tokens: int) -> Any:  # a batch alone, and one without out_cache_loc
        return NS(out_cache_loc=None) if num_tokens == 0 else NS(out_cache_loc=torch.arange(1, num_tokens + 1))


def test_the_capture_batch_writes_into_the_padding_slot_only_while_open() -> None:
    prefill, decode = Prefill(), Decode()
    with sc.dummy_writes_to_padding([Prefill, Decode, Bare]):
        batch, attn = prefill.capture_prepare(3)
        assert attn == "attn" and batch.out_cache_loc.tolist() == [0, 0, 0]
        assert prefill.static.tolist() == [0, 0, 0, 40, 41]  # in place: the buffer the graph reads
        assert decode.capture_prepare(2, num_tokens=2)[0].out_cache_loc.tolist() == [0, 0]
        assert Bare().capture_prepare(3).out_cache_loc.tolist() == [0, 0, 0]
        assert Bare().capture_prepare(0).out_cache_loc is None
        assert Prefill.capture_prepare.__name__ == "capture_prepare"
    fresh = Prefill()
    assert fresh.capture_prepare(3)[0].out_cache_loc.tolist() == [17, 18, 19]  # restored
    assert "capture_prepare" not in Decode.__dict__ or Decode.capture_prepare.__qualname__ == "Decode.capture_prepare"


def test_restored_when_the_capture_raises() -> None:
    original = Prefill.__dict__["capture_prepare"]
    with pytest.raises(RuntimeError), sc.dummy_writes_to_padding([Prefill]):
        assert Prefill.__dict__["capture_prepare"] is not original
        raise RuntimeError("CUDA out of memory")
    assert Prefill.__dict__["capture_prepare"] is original


def test_a_subclass_inherits_the_padding() -> None:
    class Draft(Prefill):  # a speculative runner deriving SGLang's class
        pass

    with sc.dummy_writes_to_padding([Prefill]):
        assert Draft().capture_prepare(2)[0].out_cache_loc.tolist() == [0, 0]


def test_per_request_state() -> None:
    assert sc.per_request_state(NS(req_to_token_pool=NS(mamba_pool=None))) is None
    assert sc.per_request_state(None) is None
    assert "mamba" in (sc.per_request_state(NS(req_to_token_pool=NS(mamba_pool=object()))) or "")


def test_without_sglang_nothing_is_patched(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sc, "RUNNER_CLASSES", ("no_such_module_here.Runner", "torch.NoSuchRunner", "torch.Tensor"))
    assert sc.runner_classes() == []  # missing module, missing class, a class without capture_prepare
    with sc.dummy_writes_to_padding():
        pass


def _device(monkeypatch: pytest.MonkeyPatch, events: list[str], initialized: bool = True) -> None:
    """``torch.cuda`` as on a machine with a GPU: synchronizations recorded, in order with the capture."""
    sc.runner_classes()  # SGLang's modules imported before the device is stood in for
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialized)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: events.append("sync"))


@pytest.mark.parametrize("raises", [False, True])
def test_a_capture_while_serving_starts_and_ends_with_the_device_idle(monkeypatch: pytest.MonkeyPatch,
                                                                      raises: bool) -> None:
    events: list[str] = []
    _device(monkeypatch, events)
    with pytest.raises(RuntimeError) if raises else contextlib.nullcontext(), sc.while_serving():
        events.append("capture")
        if raises:
            raise RuntimeError("capture failed")
    assert events == ["sync", "capture", "sync"]


def test_an_uninitialized_device_is_not_synchronized(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    _device(monkeypatch, events, initialized=False)
    with sc.quiesced():
        events.append("capture")
    assert events == ["capture"]
