"""The package's shape: imports only go "down" (no cycles), and no function is complex.

Imports are read with ``ast`` from every module of ``sglang_bcg_plugin``: module-level and
function-level ``import``/``from`` statements, relative or absolute; imports under
``if TYPE_CHECKING:`` are skipped (they never run). ``manager.BUILTIN_PLUGINS`` loads the
built-in backends by name through ``importlib`` (tox's registry pattern), which is not an import
edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

import sglang_bcg_plugin

ROOT = Path(sglang_bcg_plugin.__file__).parent
PKG = "sglang_bcg_plugin"
#: The complexity budget: no function above radon's grade C (cyclomatic complexity 11-20).
#: Modules are split by responsibility, not by length.
MAX_COMPLEXITY = 20


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, modules: set[str]) -> set[str]:
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[: len(base) - child.level + 1]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                for a in child.names:  # `from pkg import submodule` is an edge to the submodule only
                    sub = f"{target}.{a.name}"
                    found.add(sub if sub in modules else target)
            visit(child)

    visit(ast.parse(path.read_text()))
    out = set()
    for imp in found:
        while imp and imp not in modules:
            imp = imp.rsplit(".", 1)[0] if "." in imp else ""
        if imp and imp != name:
            out.add(imp)
    return out


def _graph() -> dict[str, set[str]]:
    files = sorted(ROOT.rglob("*.py"))
    modules = {_module_name(p) for p in files}
    return {_module_name(p): _imports(p, modules) for p in files}


def test_no_import_cycles() -> None:
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def dfs(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep) :] + [dep])
            elif dep not in state:
                dfs(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            dfs(node)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_top_level_package_is_imported_by_no_module() -> None:
    graph = _graph()
    offenders = sorted(m for m, deps in graph.items() if PKG in deps and m != PKG)
    assert not offenders, f"modules importing the public package (re-exports only): {offenders}"


def test_no_function_above_complexity_grade_c() -> None:
    from radon.complexity import cc_visit

    over = {
        f"{p.relative_to(ROOT)}:{block.name}": block.complexity
        for p in ROOT.rglob("*.py")
        for block in cc_visit(p.read_text())
        if block.complexity > MAX_COMPLEXITY
    }
    assert not over, f"functions above radon grade C (complexity > {MAX_COMPLEXITY}): {over}"
