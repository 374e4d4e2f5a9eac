"""The package version, read from the installed distribution's metadata."""

from __future__ import annotations

import importlib.metadata

#: Distribution name on PyPI / in ``pip list``.
DIST_NAME = "sglang-bcg-plugin"


def package_version() -> str:
    """``sglang-bcg-plugin``'s version; ``"0+unknown"`` when the package is not installed
    (imported from a source tree that was never ``pip install``-ed)."""
    try:
        return importlib.metadata.version(DIST_NAME)
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


__version__ = package_version()
