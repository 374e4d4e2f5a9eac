"""The release's runner classes build their capture batch over the static input buffers, and
:func:`~sglang_bcg_plugin.sglang.serving_capture.dummy_writes_to_padding` wraps them (SGLang 0.5.14-0.5.23)."""

from __future__ import annotations

import inspect

import pytest

from sglang_bcg_plugin.sglang import incremental as inc
from sglang_bcg_plugin.sglang import serving_capture as sc

pytestmark = [pytest.mark.sglang,
              pytest.mark.skipif(not inc.has_runner_seam(), reason="no runner classes of this shape (SGLang 0.5.13)")]


def test_both_runner_classes_build_the_capture_batch_from_the_static_slot() -> None:
    classes = sc.runner_classes()
    assert [c.__name__ for c in classes] == ["PrefillCudaGraphRunner", "DecodeCudaGraphRunner"]
    for cls in classes:
        source = inspect.getsource(cls.capture_prepare)
        assert next(iter(inspect.signature(cls.capture_prepare).parameters)) == "self"
        assert '_slot("out_cache_loc")' in source, cls  # the process-wide static buffer, not a fresh tensor
    originals = [c.__dict__["capture_prepare"] for c in classes]
    with sc.dummy_writes_to_padding():
        assert all(c.__dict__["capture_prepare"].__wrapped__ is o for c, o in zip(classes, originals, strict=True))
    assert [c.__dict__["capture_prepare"] for c in classes] == originals
