"""What a CUDA capture refused mid-way leaves behind, and which recovery lets the process capture
again (a diagnostic, not a test). ``python3 tests/gpu/abort_probe.py`` runs each recovery in a
fresh interpreter: a forward reads a value on the host inside a capture, the capture is ended
the recovery's way, then the process tries a capture into the same pool, one into a new pool,
a random op outside capture and one inside a capture."""

from __future__ import annotations

import subprocess
import sys

RECOVERIES = ["none", "plugin", "plugin+generator"]


def step(name: str, fn) -> bool:  # noqa: ANN001
    try:
        out = fn()
        print(f"  {name}: ok {out!r}"[:300], flush=True)
        return True
    except Exception as exc:  # noqa: BLE001
        print(f"  {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:240]}", flush=True)
        return False


def fresh_generator_state() -> None:
    """Give the default CUDA generator a state that is not in capture mode (seed and offset kept)."""
    import torch

    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    fresh = torch.Generator(device="cuda")
    fresh.manual_seed(gen.initial_seed())
    fresh.set_offset(gen.get_offset())
    gen.graphsafe_set_state(fresh)


def child(recovery: str) -> None:
    import torch

    from sglang_bcg_plugin.engines.cuda_segments import abort_capture

    x = torch.ones(8, device="cuda")
    torch.rand(4, device="cuda")
    pool = torch.cuda.graph_pool_handle()
    s = torch.cuda.Stream()
    print(f"--- recovery {recovery} (torch {torch.__version__})", flush=True)
    with torch.cuda.stream(s):
        g = torch.cuda.CUDAGraph()
        g.capture_begin(pool=pool)
        torch.rand(4, device="cuda")  # the generator joins the capture
        step("host read inside the capture", lambda: (x * 2).sum().item())
        if recovery == "none":
            step("capture_end", g.capture_end)
        else:
            step("abort_capture", lambda: abort_capture(g, pool))
        if recovery == "plugin+generator":
            step("fresh generator state", fresh_generator_state)
    step("capturing after", torch.cuda.is_current_stream_capturing)

    def capture(into: object) -> float:
        with torch.cuda.stream(s):
            g2 = torch.cuda.CUDAGraph()
            g2.capture_begin(pool=into)
            y = x * 3 + torch.rand(8, device="cuda") * 0
            g2.capture_end()
        g2.replay()
        torch.cuda.synchronize()
        return float(y.sum())

    step("capture into the same pool", lambda: capture(pool))
    step("capture into a new pool", lambda: capture(torch.cuda.graph_pool_handle()))
    step("random op outside capture", lambda: float(torch.rand(4, device="cuda").sum()))


def main() -> None:
    if len(sys.argv) > 1:
        child(sys.argv[1])
        return
    for recovery in RECOVERIES:
        subprocess.run([sys.executable, __file__, recovery], check=False)


if __name__ == "__main__":
    main()
