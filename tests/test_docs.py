"""Docs stay honest: hooks.md documents every hook with its exact signature; README runs."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import sglang_bcg_plugin
from sglang_bcg_plugin import hookspecs

ROOT = Path(__file__).resolve().parents[1]


def _signature(name: str) -> str:
    sig = inspect.signature(getattr(hookspecs, name))
    params = ", ".join(f"{p.name}: {p.annotation}" for p in sig.parameters.values())
    return f"{name}({params}) -> {sig.return_annotation}"


def test_every_hook_documented_with_exact_signature() -> None:
    hooks = sorted(n for n in dir(hookspecs) if n.startswith("sglang_bcg_"))
    headings = re.findall(r"^## (sglang_bcg_\S+\(.*)$", (ROOT / "docs" / "hooks.md").read_text(), re.M)
    assert sorted(headings) == sorted(_signature(h) for h in hooks)
    assert len(hooks) >= 3


def test_hooks_are_prefixed_and_documented() -> None:
    for name, fn in inspect.getmembers(hookspecs, inspect.isfunction):
        if fn.__module__ != hookspecs.__name__:
            continue
        assert name.startswith("sglang_bcg_")
        assert fn.__doc__ and ":param" in fn.__doc__


def test_readme_usage_example_runs() -> None:
    code = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)[0]
    namespace: dict[str, object] = {}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - our own README
    backend = namespace["backend"]
    report = backend.memory_report()  # type: ignore[attr-defined]
    assert report.resident_output_bytes == 512 * 64 * 4


def test_public_api_is_reexported() -> None:
    for name in sglang_bcg_plugin.__all__:
        assert hasattr(sglang_bcg_plugin, name)
    assert {"ShapeKey", "BackendOptions", "create_backend", "available_backends", "get_plugin_manager", "hookimpl",
            "OutputStructureError", "MemoryReport", "resolve_share_output"} <= set(sglang_bcg_plugin.__all__)


def test_changelog_has_unreleased_section() -> None:
    text = (ROOT / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in text and "### Added" in text


def test_readme_test_command_is_what_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    pytest_cmd = re.search(r"python -m pytest ([^\n`]*)", readme)
    assert pytest_cmd is not None
    assert f"-m pytest {pytest_cmd.group(1).strip()}" in ci
    assert "bash .ci/setup.sh" in readme and ".ci/setup.sh" in ci
    assert "sglang-bcg bench" in readme
