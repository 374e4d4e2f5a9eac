"""The CPU server test's preconditions: SGLang 0.5.23, the server's packages, our entry point.

Missing ones skip the test with the reason, or fail it when ``SGLANG_BCG_REQUIRE_SGLANG=1`` (CI):
``.ci/setup.sh`` installs all of them.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os

import pytest

#: The release whose CPU path the test drives (its sgl_kernel names, ``site/sgl_kernel``).
RELEASE = "0.5.23"
#: Import names of the packages the server needs beyond the import set of ``tests/sglang``
#: (``.ci/setup.sh`` says why each one).
SERVER_MODULES = ("fastapi", "uvicorn", "uvloop", "setproctitle", "python_multipart", "xgrammar",
                  "jsonschema", "soundfile", "psutil")


@functools.cache
def server_problem() -> str | None:
    """Why the real server cannot run here, or ``None``."""
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return "SGLang is not installed"
    if version != RELEASE:
        return f"SGLang {version} is installed; the CPU server test drives {RELEASE}'s CPU path"
    missing = [name for name in SERVER_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        return f"the server's packages are missing: {', '.join(missing)} (bash .ci/setup.sh installs them)"
    points = importlib.metadata.entry_points(group="sglang.srt.plugins")
    if not any(ep.value == "sglang_bcg_plugin.sglang:register" for ep in points):
        return "the sglang.srt.plugins entry point is not installed (pip install -e . from the checkout)"
    return None


@pytest.fixture(autouse=True, scope="module")
def _require_server() -> None:
    problem = server_problem()
    if problem is None:
        return
    if os.environ.get("SGLANG_BCG_REQUIRE_SGLANG") == "1":
        pytest.fail(f"SGLANG_BCG_REQUIRE_SGLANG=1 but {problem}", pytrace=False)
    pytest.skip(problem)
