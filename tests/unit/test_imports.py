"""Every product and experiments module imports: a module that names one moved or renamed (a merge's leftovers)
fails here rather than when someone first runs that command."""

from __future__ import annotations

import importlib
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def modules() -> list[str]:
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    if not files:  # not a git checkout: walk the folders
        files = [os.path.relpath(os.path.join(d, f), ROOT) for d, _, fs in os.walk(ROOT) for f in fs
                 if f.endswith(".py") and ".venv" not in d]
    return sorted(f[:-3].replace(os.sep, ".").removesuffix(".__init__") for f in files
                  if not f.startswith(("tests", ".")) and "_pb2" not in f)


@pytest.mark.parametrize("name", modules())
def test_module_imports(name):
    importlib.import_module(name)
