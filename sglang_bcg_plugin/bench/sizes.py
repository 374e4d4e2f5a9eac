"""SGLang's prefill capture sizes (``generate_prefill_cuda_graph_batch_sizes``, 0.5.23)."""

from __future__ import annotations

#: The smallest prefill capture size of SGLang's schedule.
MIN_CAPTURE_SIZE = 4


def prefill_capture_sizes(max_tokens: int) -> list[int]:
    """Token counts SGLang 0.5.23 captures for prefill, ascending, up to ``max_tokens``.

    58 sizes up to 8192, 74 up to 16384. Mirrors SGLang's schedule (checked on the 0.5.23
    wheel) so the benchmark needs no SGLang install.
    """
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < MIN_CAPTURE_SIZE:
        msg = f"max_tokens must be an int >= {MIN_CAPTURE_SIZE} (the smallest prefill capture size), got {max_tokens!r}"
        raise ValueError(msg)
    sizes = (
        list(range(4, 33, 4))
        + list(range(48, 257, 16))
        + list(range(288, 513, 32))
        + list(range(576, 1025, 64))
        + list(range(1280, 4097, 256))
        + list(range(4608, max_tokens + 1, 512))
    )
    return [s for s in sizes if s <= max_tokens]
