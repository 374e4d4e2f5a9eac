"""Outputs the graph did not produce: a parameter beside the output (tied-head code), a buffer, an
input returned as it is, a constant made before capture, one tensor twice, inside tuples and dicts.

Every backend and output mode hands them back right (the very tensor, or its values) after the
inputs and the weights changed; a forward that returns something else at replay gets an error
naming the real difference (path, tensor type, keys, shape). ``foreign_case`` is a function of
``(device, engine)``, as in ``tests/test_wrong_values.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from sglang_bcg_plugin import BackendOptions, ShapeKey, create_backend
from sglang_bcg_plugin.trees import diff, flatten

BACKENDS = ["full", "breakable", "piecewise"]
MODES = ["off", "on", "released"]
KINDS = ["param", "param_dict", "input", "buffer", "repeat", "constant", "dict"]
SIZES = (6, 3, 1)


class Tied(torch.nn.Module):
    """An embedding whose weight a forward returns beside its hidden states, as tied heads do."""

    def __init__(self, device: str) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.embed = torch.nn.Embedding(11, 5).to(device)
        with torch.no_grad():
            self.embed.weight.copy_(torch.randn(11, 5, generator=g))
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 5, device=device))
        self.constant = torch.full((2, 3), 7.0, device=device)  # made before any capture

    def forward(self, ids: torch.Tensor, kind: str) -> Any:
        h = self.embed(ids) * self.scale + 1
        return {
            "param": lambda: (h, self.embed.weight),
            "param_dict": lambda: {"logits": h @ self.embed.weight.T, "weight": self.embed.weight},
            "input": lambda: (h, ids),
            "buffer": lambda: [self.scale, h],
            "repeat": lambda: (h, h, h.sum(-1)),
            "constant": lambda: (self.constant, h),
            "dict": lambda: {"h": h, "again": h, "tag": "hidden"},
        }[kind]()


def _leaves(out: Any) -> list[torch.Tensor]:
    return [t for _, t in flatten(out)[1]]


def foreign_case(name: str, mode: str, kind: str, device: str, engine: str) -> None:
    """Capture ``SIZES`` largest first, change the ids and the weight in place, replay every size
    against the eager forward; leaves the forward returned as they are come back equal to them."""
    torch._dynamo.reset()
    model = Tied(device).eval()
    ids = torch.randint(0, 11, (max(SIZES),), generator=torch.Generator().manual_seed(1)).to(device)
    backend = create_backend(name, options=BackendOptions(output_mode=mode, engine=engine))
    fn: Callable[..., Any] = backend.compile(model) if name == "piecewise" else model
    with torch.no_grad(), backend.capture_session():
        for n in SIZES:
            backend.capture_one(ShapeKey(n), lambda n=n: fn(ids[:n], kind), capture_inputs=ids)
    with torch.no_grad():
        ids.copy_(torch.randint(0, 11, ids.shape, generator=torch.Generator().manual_seed(2)).to(device))
        model.embed.weight.mul_(-2.0)  # weights updated in place (a reload): replay sees them
        model.scale.add_(1.0)
        model.constant.fill_(-3.0)
        for n in (1, 6, 3, 6):
            got, want = backend.replay(ShapeKey(n)), model(ids[:n], kind)
            assert type(got) is type(want)
            if isinstance(want, dict):
                assert list(got) == list(want) and got.get("tag") == want.get("tag")
            for a, b in zip(_leaves(got), _leaves(want), strict=True):
                assert type(a) in (torch.Tensor, type(b)) and a.dtype == b.dtype and a.shape == b.shape
                torch.testing.assert_close(a, b, rtol=0, atol=0)
    backend.cleanup()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", BACKENDS)
def test_outputs_the_graph_did_not_make_replay_right(name: str, mode: str, kind: str) -> None:
    foreign_case(name, mode, kind, "cpu", "eager")


@pytest.mark.parametrize("mode", MODES)
def test_full_hands_back_the_parameter_itself_without_a_copy_off_and_a_copy_on(mode: str) -> None:
    """Sharing off: the parameter itself, as the forward returned it; on: a private buffer of the
    partition (never the weight: a smaller key would write into it), refreshed at every replay."""
    model = Tied("cpu").eval()
    ids = torch.arange(6) % 11
    backend = create_backend("full", options=BackendOptions(output_mode=mode, engine="eager"))
    with torch.no_grad(), backend.capture_session():
        for n in (6, 2):
            backend.capture_one(ShapeKey(n), lambda n=n: model(ids[:n], "param"), capture_inputs=ids)
    weight = model.embed.weight
    before = weight.detach().clone()
    with torch.no_grad():
        out = backend.replay(ShapeKey(2))
    assert (out[1] is weight) is (mode != "on")
    torch.testing.assert_close(weight.detach(), before)  # no replay wrote into the weight
    assert backend.memory_report().fallbacks == {}


class Marked(torch.Tensor):
    """A tensor subclass (a forward returns it at capture only, below)."""


def test_a_parameter_and_a_plain_tensor_are_the_same_leaf() -> None:
    """A Parameter is its values: no structure change against a plain tensor (no fallback, no
    replay error); another tensor subclass is named, with its module, never "a tensor, got a tensor"."""
    t = torch.ones(2)
    assert diff(flatten((t, torch.nn.Parameter(t)))[0], flatten((t, t))[0]) is None
    path, reason = diff(flatten((t, t.as_subclass(Marked)))[0], flatten((t, t))[0]) or ("", "")
    assert path == "output[1]" and "tensor type changed" in reason and "Marked tensor" in reason
    assert "expected a tensor, got a tensor" not in reason


def _replayed_error(returns: Callable[[int], Callable[[], Any]]) -> str:
    backend = create_backend("full", options=BackendOptions(output_mode="on", engine="eager"))
    with torch.no_grad(), backend.capture_session():
        backend.capture_one(ShapeKey(4), returns(0))
    backend._state.entry(ShapeKey(4)).graph._forward_fn = returns(1)  # the forward changes its mind
    with pytest.raises(RuntimeError) as info:
        backend.replay(ShapeKey(4))
    return str(info.value)


def test_a_replay_returning_something_else_names_the_difference() -> None:
    x = torch.randn(4, 3)
    subclass = _replayed_error(lambda call: (lambda: (x * 2, (x + 1).as_subclass(Marked) if call == 0 else x + 1)))
    assert "output[1]" in subclass and "Marked tensor" in subclass and "a tensor, got a tensor" not in subclass
    changed = _replayed_error(lambda call: (lambda: {"y": x * 2} if call == 0 else {"z": x * 2}))
    assert "output: dict keys changed: expected ['y'], got ['z']" in changed
    shape = _replayed_error(lambda call: (lambda: [x[: 4 - call] * 2]))
    assert "output[0]" in shape and "(3, 3)" in shape and "(4, 3)" in shape
