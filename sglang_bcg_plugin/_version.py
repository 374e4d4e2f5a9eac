"""The package version, read from the installed distribution's metadata."""

from __future__ import annotations

import importlib.metadata

#: Distribution name on PyPI / in ``pip list``.
DIST_NAME = "sglang-bcg-plugin"


def package_version(dist: str = DIST_NAME, missing: str = "0+unknown") -> str:
    """The installed version of distribution ``dist``, else ``missing`` (a source tree never installed)."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return missing


__version__ = package_version()
