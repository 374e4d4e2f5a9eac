"""What a CUDA capture refused mid-way leaves behind (a diagnostic, not a test): each step's
outcome when a forward reads a value on the host inside ``capture_begin``/``capture_end``."""

from __future__ import annotations

import torch


def step(name: str, fn) -> None:  # noqa: ANN001
    try:
        out = fn()
        print(f"{name}: ok {out!r}"[:300], flush=True)
    except Exception as exc:  # noqa: BLE001
        print(f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0][:240]}", flush=True)


def main() -> None:
    x = torch.ones(8, device="cuda")
    pool = torch.cuda.graph_pool_handle()
    s = torch.cuda.Stream()
    for read in ("item", "nonzero"):
        print(f"--- {read}, pool {pool}")
        with torch.cuda.stream(s):
            g = torch.cuda.CUDAGraph()
            g.capture_begin(pool=pool)
            step("forward", (lambda: (x * 2).sum().item()) if read == "item" else (lambda: torch.nonzero(x)))
            step("capturing after the read", torch.cuda.is_current_stream_capturing)
            step("capture_end", g.capture_end)
            step("capturing after capture_end", torch.cuda.is_current_stream_capturing)
            for i in range(4):
                step(f"endAllocateToPool #{i}", lambda: torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), pool))
            step("reset", g.reset)
            g2 = torch.cuda.CUDAGraph()
            step("capture_begin again", lambda: g2.capture_begin(pool=pool))
            step("work", lambda: x.add_(1))
            step("capture_end again", g2.capture_end)
        step("random op after", lambda: torch.rand(4, device="cuda").sum().item())
        pool = torch.cuda.graph_pool_handle()


if __name__ == "__main__":
    main()
