"""The scheduler and the HTTP API install without the worker's packages: pyproject.toml's core dependencies cover
every library they import, and importing them (and the CLI that starts them) loads none of torch, xgrammar,
safetensors, ninja, triton or transformers. The worker's packages are the `worker` extra."""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import os
import re
import subprocess
import sys

import tomllib
from packaging.requirements import Requirement

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OWN = {"common", "protos", "scheduler_svc", "api_svc", "worker_svc", "kernels", "llmserve", "__future__"}
WORKER_ONLY = ("torch", "xgrammar", "safetensors", "ninja", "triton", "transformers")
# Lazy imports in shared modules that only the worker's code paths reach.
WORKER_PATHS = {
    ("common/structured_outputs.py", "xgrammar"),  # build_grammar: the worker compiles grammars
    ("common/gguf_sentencepiece.py", "transformers"),  # only a SentencePiece GGUF; refused with a clear error without
}


def _pyproject() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", Requirement(requirement).name).lower()


def _with_dependencies(names: set[str]) -> set[str]:
    """The distributions and everything they require (unconditionally), as installed here."""
    seen, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for r in metadata.requires(name) or []:
            req = Requirement(r)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(_name(r))
    return seen


def _imports(package: str) -> set[tuple[str, str]]:
    """(file, top-level module) of every import, lazy ones included, of the package's files."""
    found = set()
    for dirpath, _, names in os.walk(os.path.join(ROOT, package)):
        for n in (n for n in names if n.endswith(".py")):
            path = os.path.join(dirpath, n)
            with open(path) as f:
                tree = ast.parse(f.read(), path)
            rel = os.path.relpath(path, ROOT)
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    found.update((rel, a.name.split(".")[0]) for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    found.add((rel, node.module.split(".")[0]))
    return {(f, m) for f, m in found if m not in OWN and m not in sys.stdlib_module_names}


def test_core_dependencies_leave_the_worker_packages_to_the_worker_extra():
    project = _pyproject()
    core = {_name(r) for r in project["dependencies"]}
    assert not core & set(WORKER_ONLY), "the scheduler and the API would install the worker's packages"
    assert {"torch", "xgrammar", "safetensors", "ninja"} <= {_name(r) for r in project["optional-dependencies"]
                                                              ["worker"]}


def test_the_core_dependencies_cover_what_the_scheduler_and_the_api_import():
    installed = _with_dependencies({_name(r) for r in _pyproject()["dependencies"]})
    by_module = metadata.packages_distributions()
    missing = []
    for package in ("scheduler_svc", "api_svc", "common", "protos"):
        for path, module in sorted(_imports(package)):
            dists = {re.sub(r"[-_.]+", "-", d).lower() for d in by_module.get(module, [module])}
            if (path, module) not in WORKER_PATHS and not dists & installed:
                missing.append(f"{path} imports {module} ({', '.join(sorted(dists))})")
    assert not missing, "not among pyproject.toml's core dependencies:\n" + "\n".join(missing)


def test_the_scheduler_the_api_and_the_cli_load_no_worker_package():
    code = ("import sys; import scheduler_svc.servers.process, api_svc.app, api_svc.server, llmserve.cli; "
            "llmserve.cli.build_parser(); "
            f"print(sorted(m for m in {WORKER_ONLY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
