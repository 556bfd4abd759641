"""No import cycle between the product's modules.

Every module of the product packages is read with `ast`: imports at module level, inside functions (a lazy import that
closes a loop is still a loop, only hidden until the function runs) and under `if TYPE_CHECKING:` (a type-only ring
still ties the modules together for a reader, a type checker and every later refactoring) all count.
"""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("common", "kernels", "protos", "api_svc", "scheduler_svc", "worker_svc", "llmserve")


def module_files(root: str = ROOT, packages=PACKAGES) -> dict[str, str]:
    """Dotted module name -> path, for every .py file of `packages` (a package is its __init__)."""
    out = {}
    for package in packages:
        for dirpath, _, names in os.walk(os.path.join(root, package)):
            for name in names:
                if name.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, name), root)[:-3].split(os.sep)
                    out[".".join(rel[:-1] if rel[-1] == "__init__" else rel)] = os.path.join(dirpath, name)
    return out


def _imports(tree: ast.AST):
    """Every import node in `tree`: module level, inside functions, under `if TYPE_CHECKING:`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node


def imported_modules(name: str, path: str, known: set[str]) -> set[str]:
    """The product modules `name` (at `path`) imports."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    for node in _imports(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(p for p in (*parts, base) if p)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for target in targets:
            while target and target not in known:  # `import a.b.c` where only a.b is a module of ours
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph(root: str = ROOT, packages=PACKAGES) -> dict[str, set[str]]:
    files = module_files(root, packages)
    known = set(files)
    return {name: imported_modules(name, path, known) for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_no_import_cycle_in_the_product():
    graph = import_graph()
    assert "llmserve.cli" in graph and "scheduler_svc.servers.process" in graph
    found = cycles(graph)
    assert not found, "import cycles (imports inside functions and under TYPE_CHECKING count):\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_the_check_sees_lazy_and_type_checking_imports(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg import b\n")
    (pkg / "b.py").write_text("from pkg.a import f\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import d\n")
    (pkg / "d.py").write_text("from . import c\n")
    graph = import_graph(str(tmp_path), ("pkg",))
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.a"}
    assert graph["pkg.c"] == {"pkg.d"} and graph["pkg.d"] == {"pkg.c"}
    assert cycles(graph) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"]]
