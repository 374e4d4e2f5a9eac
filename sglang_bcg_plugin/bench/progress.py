"""The capture progress bar: tqdm when installed (the ``[bench]`` extra), else a plain line."""

from __future__ import annotations

import sys
from typing import Any, TextIO


class LineProgress:
    """tqdm's ``update``/``close`` subset, written as one rewritten stderr line."""

    def __init__(self, total: int, desc: str, stream: TextIO, enabled: bool) -> None:
        self.total, self.desc, self.stream, self.enabled = total, desc, stream, enabled
        self.n = 0

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.enabled:
            self.stream.write(f"\r{self.desc}: {self.n}/{self.total} sizes")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.n:
            self.stream.write("\r" + " " * (len(self.desc) + 2 * len(str(self.total)) + 10) + "\r")
            self.stream.flush()


def progress(total: int, desc: str, enabled: bool) -> Any:
    """A progress bar over ``total`` capture sizes (hidden when not ``enabled``)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return LineProgress(total, desc, sys.stderr, enabled)
    return tqdm(total=total, desc=desc, unit="size", file=sys.stderr, disable=not enabled, leave=False)
