"""Docs stay honest: hooks.md documents every hook with its exact signature; README runs."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

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


def _python_blocks(relpath: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / relpath).read_text(), re.S)


@pytest.mark.parametrize("relpath", ["README.md", "docs/getting-started.md", "docs/index.md"])
def test_python_snippets_run_as_written(relpath: str, capsys: pytest.CaptureFixture[str]) -> None:
    blocks = _python_blocks(relpath)
    assert blocks
    for i, code in enumerate(blocks):
        namespace: dict[str, object] = {}
        exec(compile(code, f"{relpath} python block {i + 1}", "exec"), namespace)  # noqa: S102 - our own docs
    assert "resident" in capsys.readouterr().out  # both end by printing a memory report


def test_readme_usage_example_keeps_one_buffer() -> None:
    namespace: dict[str, object] = {}
    exec(compile(_python_blocks("README.md")[0], "README.md", "exec"), namespace)  # noqa: S102
    backend = namespace["backend"]
    report = backend.memory_report()  # type: ignore[attr-defined]
    assert report.resident_output_bytes == 512 * 64 * 4


def _doc_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
    files += sorted((ROOT / ".ci").iterdir()) + sorted(
        p for p in (ROOT / "scripts").rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    return files + sorted((ROOT / "sglang_bcg_plugin").rglob("*.py"))


def test_docs_reference_only_files_in_the_repository() -> None:
    for path in _doc_files():
        text = path.read_text()
        rel = path.relative_to(ROOT)
        assert "DESIGN.md" not in text and "DESIGN §" not in text and "../shared" not in text, rel
        if path.suffix == ".md":
            for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
                if "://" not in target:
                    assert (path.parent / target).exists(), f"{rel} links to missing {target}"


def _slug(title: str) -> str:
    """GitHub's anchor of a heading: links and code spans unwrapped, lowercase, punctuation dropped
    (``-`` and ``_`` kept), spaces to ``-``."""
    title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title).replace("`", "")
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def _anchors(doc: Path) -> set[str]:
    """Every heading anchor of a Markdown file (a repeated heading gets ``-1``, ``-2``, ...)."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in doc.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)):
            slug = _slug(m.group(1))
            found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return found


def test_anchor_slugs_follow_githubs_rule() -> None:
    assert _slug("The driver's share: how it is modelled") == "the-drivers-share-how-it-is-modelled"
    assert _slug("Inductor pieces (`inductor=True`)") == "inductor-pieces-inductortrue"
    assert _slug("See [the plan](sglang.md#x)") == "see-the-plan"


def test_code_cites_only_docs_sections_that_exist() -> None:
    """Code and scripts cite a section as ``docs/FILE.md#anchor``, and the anchor is a heading of
    that file today; Markdown links (``](FILE.md#anchor)``) in the docs likewise. A title in quotes
    after a path (``docs/x.md, "Title"``) is refused: nothing could check it."""
    broken, by_title = [], []
    for path in _doc_files():
        text, rel = path.read_text(), path.relative_to(ROOT)
        cites = [(ROOT / "docs" / f"{name}.md", anchor) for name, anchor in re.findall(r"docs/([\w-]+)\.md#([\w-]+)", text)]
        if path.suffix == ".md":
            cites += [((path.parent / target) if target else path, anchor)
                      for target, anchor in re.findall(r"\]\(([^)#\s:]*\.md|)#([^)\s]+)\)", text)]
        broken += [f"{rel}: {doc.relative_to(ROOT)}#{anchor}" for doc, anchor in cites
                   if not doc.exists() or anchor not in _anchors(doc)]
        if path.suffix == ".py":
            by_title += [f"{rel}: {m}" for m in re.findall(r"docs/[\w-]+\.md[,:]?\s*\(?[\"'][A-Z][^\"']*", text)]
    assert not broken, "citations of sections that do not exist:\n" + "\n".join(broken)
    assert not by_title, "cite sections as docs/FILE.md#anchor:\n" + "\n".join(by_title)


def test_install_commands_work_from_a_checkout() -> None:
    """The package is not on PyPI: no ``pip install sglang-bcg-plugin`` anywhere."""
    for path in _doc_files():
        text = path.read_text()
        assert not re.search(r"pip install ['\"]?sglang-bcg-plugin", text), path.relative_to(ROOT)
    assert "pip install -e '.[sglang]'" in (ROOT / "docs" / "sglang.md").read_text()
    assert "pip install -e '.[sglang]'" in (ROOT / "README.md").read_text()


def test_public_api_is_reexported() -> None:
    for name in sglang_bcg_plugin.__all__:
        assert hasattr(sglang_bcg_plugin, name)
    assert {"ShapeKey", "BackendOptions", "create_backend", "available_backends", "get_plugin_manager", "hookimpl",
            "OutputStructureError", "MemoryReport", "resolve_output_mode"} <= set(sglang_bcg_plugin.__all__)


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
