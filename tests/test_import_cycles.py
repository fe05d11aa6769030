"""No import cycles among the project's modules, counting imports inside functions too.

An import inside a function still makes its module depend on the imported one; using it to break a cycle
only hides the cycle until the call. The graph here has an edge A -> B for every `import B` / `from B import x`
in A at any depth (module level, functions, classes), except under `if TYPE_CHECKING:` (never executed).
`from P import x` is an edge to the submodule P.x when there is one, else to P; `from P.Q import x` is an
edge to P.Q only (its package's `__init__` runs first, but an `__init__` that re-exports or looks up its
submodules is a registry, not a cycle of design).
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "auditor", "bench")


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _type_checking_block(node: ast.AST) -> bool:
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if _type_checking_block(node):
            for child in node.orelse:  # type: ignore[attr-defined]
                visit(child)
            return
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative import
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            edges |= {t for t in targets if t in modules and t != name}
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))

    def strongconnect(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return sorted(found)


def test_the_checker_finds_a_cycle_through_a_function_level_import(tmp_path: Path) -> None:
    """The check can fail: two modules importing each other, one of them inside a function."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import g\n\ndef f():\n    return g()\n")
    (pkg / "b.py").write_text("def g():\n    from pkg import a\n    return a\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n")
    modules = {module_name(p, tmp_path): p for p in sorted(pkg.rglob("*.py"))}
    assert cycles(import_graph(modules)) == [["pkg.a", "pkg.b"]]


def test_no_import_cycles() -> None:
    found = cycles(import_graph(project_modules()))
    assert not found, "import cycles (function-level imports included): " + "; ".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize("package", ["engine", "auditor"])
def test_every_module_imports_alone(package: str) -> None:
    """Each module imports first in a fresh interpreter (an order-dependent import breaks here), except the
    ones that need a GPU-only package."""
    modules = [m for m in project_modules() if m.split(".")[0] == package and not m.endswith("__main__")]
    code = ("import importlib, sys\nbad = []\n"
            f"for m in {modules!r}:\n"
            "    for k in [k for k in sys.modules if k.split('.')[0] in ('engine', 'auditor')]:\n"
            "        del sys.modules[k]\n"
            "    try:\n        importlib.import_module(m)\n"
            "    except ImportError as exc:\n"
            "        if 'flash_attn' not in str(exc):\n            bad.append((m, repr(exc)))\n"
            "print(bad)\nsys.exit(1 if bad else 0)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_the_pure_python_core_imports_without_torch() -> None:
    """The scheduler, verifier, sequence and block manager are plain Python (tensors live at the rim: model
    runner, sampler, processors): importing them in a fresh interpreter loads no torch."""
    code = ("import sys\n"
            "import engine.scheduler, engine.verifier, engine.sequence, engine.block_manager\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.split('.')[0] == 'engine')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
