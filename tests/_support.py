"""Helpers shared by the CPU tests."""

from __future__ import annotations

from sglang_bcg_plugin.output.mode import mode_of_option

import torch

from sglang_bcg_plugin import BackendOptions, create_backend
from sglang_bcg_plugin.backends.base import CaptureBackend


def make_backend(name: str, share: bool, **opts: object) -> CaptureBackend:
    return create_backend(name, options=BackendOptions(output_mode=mode_of_option(share), engine="eager", **opts))  # type: ignore[arg-type]


class Model:
    """A tiny forward with static inputs per size; outputs built by ``shape``."""

    def __init__(self, hidden: int = 8, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.hidden = hidden
        self.w = torch.randn(hidden, hidden, generator=g)
        self.inputs: dict[object, torch.Tensor] = {}

    def input_for(self, key: object, rows: int) -> torch.Tensor:
        if key not in self.inputs:
            self.inputs[key] = torch.randn(rows, self.hidden)
        return self.inputs[key]

    def refill(self) -> None:
        for x in self.inputs.values():
            x.copy_(torch.randn_like(x))
