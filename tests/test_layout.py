"""The package's shape: imports only go "down" (no cycles), and no function is complex.

Imports are read with ``ast`` from every module of ``sglang_bcg_plugin``: module-level and
function-level ``import``/``from`` statements, relative or absolute, those under ``if TYPE_CHECKING:``
included (a circle of type-only imports is still a circle for the reader). ``manager.BUILTIN_PLUGINS`` loads the
built-in backends by name through ``importlib`` (tox's registry pattern), which is not an import
edge.

The core (every module but ``sglang/``, ``cli.py``, ``bench/`` and ``__main__.py``) knows
nothing of SGLang or the CLI: it names no SGLang-only switch and imports neither SGLang nor those
packages, except where :data:`CORE_MAY_NAME_SGLANG` says why.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import sglang_bcg_plugin

ROOT = Path(sglang_bcg_plugin.__file__).parent
PKG = "sglang_bcg_plugin"
#: The complexity budget: no function above radon's grade C (cyclomatic complexity 11-20).
#: Modules are split by responsibility, not by length.
MAX_COMPLEXITY = 20

#: Outside the core (``cli`` also stands for ``cli*``, see :func:`_is_core`).
NOT_CORE = (f"{PKG}.sglang", f"{PKG}.cli", f"{PKG}.bench")
#: Names that belong to SGLang's server or to the command line, never to the core.
SGLANG_OR_CLI_NAMES = re.compile(
    r"server_args|SGLANG_BCG_STALE_OUTPUT_GUARD|SGLANG_BCG_SHARED_BUFFER|SGLANG_BCG_FORECAST|UsageError"
)
#: The only core functions that may name those (or import the integration, inside the function),
#: ``module:qualname`` -> why.
CORE_MAY_NAME_SGLANG = {
    f"{PKG}.hookspecs:sglang_bcg_select_backend": "the SGLang routing hookspec: plugin authors implement "
    "it with this exact signature (docs/hooks.md), so its parameter keeps SGLang's name",
}


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


def _imports(path: Path, modules: set[str], type_only: bool = True) -> set[str]:
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child) and not type_only:
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


def _is_core(module: str) -> bool:
    """Not ``sglang``, ``bench``, ``cli*`` or ``__main__`` (the CLI's ``python -m``)."""
    top = module.removeprefix(f"{PKG}.").split(".")[0]
    return module == PKG or not (top in ("sglang", "bench", "__main__") or top.startswith("cli"))


def _import_targets(node: ast.Import | ast.ImportFrom, package: str) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not node.level:
        return [node.module or ""]
    base = package.split(".")[: len(package.split(".")) - node.level + 1]
    target = ".".join(base + ([node.module] if node.module else []))
    return [f"{target}.{a.name}" for a in node.names]


def _scopes(tree: ast.Module) -> list[tuple[str, int, int]]:
    """(qualname, first line, last line) of every function, decorators included."""
    out: list[tuple[str, int, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                    out.append((name, first, child.end_lineno or child.lineno))
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return out


def _allowed(module: str, scopes: list[tuple[str, int, int]], line: int) -> bool:
    return any(f"{module}:{q}" in CORE_MAY_NAME_SGLANG and a <= line <= b for q, a, b in scopes)


def _core_files() -> list[tuple[str, Path]]:
    files = [(_module_name(p), p) for p in sorted(ROOT.rglob("*.py"))]
    return [(m, p) for m, p in files if _is_core(m)]


def test_core_names_no_sglang_or_cli_switch() -> None:
    """``server_args``, the integration's env vars, the CLI's ``UsageError``."""
    offenders = []
    for module, path in _core_files():
        text = path.read_text()
        scopes = _scopes(ast.parse(text))
        for number, line in enumerate(text.splitlines(), 1):
            if SGLANG_OR_CLI_NAMES.search(line) and not _allowed(module, scopes, number):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "the core names SGLang's server or the CLI:\n" + "\n".join(offenders)


def test_core_does_not_import_sglang_the_integration_or_the_cli() -> None:
    """Never SGLang; ``sglang``/``cli``/``bench`` never at module level, and inside a function
    only where :data:`CORE_MAY_NAME_SGLANG` allows it."""
    offenders = []
    for module, path in _core_files():
        tree = ast.parse(path.read_text())
        scopes = _scopes(tree)
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _import_targets(node, package):
                where = f"{path.relative_to(ROOT)}:{node.lineno}: {target}"
                if target == "sglang" or target.startswith("sglang."):
                    offenders.append(f"{where} (SGLang)")
                elif any(target == n or target.startswith(n + ".") for n in NOT_CORE):
                    inside = any(a <= node.lineno <= b for _, a, b in scopes)
                    if not inside or not _allowed(module, scopes, node.lineno):
                        offenders.append(where + (" (inside a function not allow-listed)" if inside else " (module level)"))
    assert not offenders, "the core imports SGLang or the outer packages:\n" + "\n".join(offenders)


def test_layout_checks_catch_what_they_claim() -> None:
    """The checks above on a made-up core module: a module-level import of the integration, a
    ``server_args`` outside the allow-list, ``import sglang`` inside a function."""
    source = (
        "from .sglang import flag\n"
        "def f(server_args):\n"
        "    import sglang.srt\n"
        "    return server_args\n"
    )
    tree = ast.parse(source)
    scopes = _scopes(tree)
    assert scopes == [("f", 2, 4)]
    assert not _allowed(f"{PKG}.made_up", scopes, 2)
    assert _allowed(f"{PKG}.hookspecs", [("sglang_bcg_select_backend", 1, 9)], 5)
    imports = [t for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for t in _import_targets(n, PKG)]
    assert imports == [f"{PKG}.sglang.flag", "sglang.srt"]
    assert _is_core(PKG) and _is_core(f"{PKG}.backends.base") and _is_core(f"{PKG}.registry")
    outer = ("sglang", "sglang.flag", "bench.usage", "cli", "cli_helpers", "__main__")
    assert not any(_is_core(f"{PKG}.{m}") for m in outer)
