"""Dependencies point one way: common <- services (scheduler_svc, worker_svc, api_svc, kernels) <- the llmserve CLI,
and the product never imports the test and benchmark harness (tests/, experiments/).

Every import statement (module level or inside a function) of every file is read with `ast`, so a lazy import
that runs the wrong way fails here too.
"""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HARNESS = {"tests", "experiments"}
# package -> top-level packages of this repository it must not import
FORBIDDEN = {
    "protos": {"common", "llmserve", "scheduler_svc", "worker_svc", "api_svc", "kernels"} | HARNESS,
    "common": {"llmserve", "scheduler_svc", "worker_svc", "api_svc", "kernels"} | HARNESS,
    "kernels": {"llmserve", "scheduler_svc", "worker_svc", "api_svc"} | HARNESS,
    "scheduler_svc": {"llmserve", "worker_svc", "api_svc"} | HARNESS,
    "worker_svc": {"llmserve", "scheduler_svc", "api_svc"} | HARNESS,
    # The HTTP API reaches the scheduler only over gRPC (test_api_imports_only_common_and_protos).
    "api_svc": {"llmserve", "scheduler_svc", "worker_svc", "kernels"} | HARNESS,
    "llmserve": HARNESS,
}
# The settings' modules are read to build every command line (and the docs): no I/O library, no model code.
CONFIG_MODULES = ("common/config.py", "scheduler_svc/config.py", "worker_svc/config.py", "api_svc/config.py")
# The scheduling core (every module of scheduler_svc/core/) is plain data in, plain data out: no I/O library, no wire
# format.
PURE_PACKAGE = "scheduler_svc/core"
IO_LIBRARIES = {"grpc", "redis", "opentelemetry", "torch", "protos", "prometheus_client", "google"}
# The worker's core and its parts see plain plans and return plain arrays: the wire is worker_svc/wire.py's.
WIRE_FREE_PACKAGES = ("worker_svc/core", "worker_svc/sampling", "worker_svc/cpu", "worker_svc/parallel")
WIRE = {"grpc", "grpc_health", "grpc_reflection", "protos", "google"}
PRODUCT_PACKAGES = ("api_svc", "common", "kernels", "llmserve", "scheduler_svc", "worker_svc")
MAX_PRODUCT_LINES = 450


def imported_packages(path: str) -> set[tuple[int, str]]:
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update((node.lineno, a.name.split(".")[0]) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add((node.lineno, node.module.split(".")[0]))
    return found


def python_files(package: str) -> list[str]:
    out = []
    for dirpath, _, names in os.walk(os.path.join(ROOT, package)):
        out += [os.path.join(dirpath, n) for n in names if n.endswith(".py") and not n.endswith(("_pb2.py",
                                                                                                  "_pb2_grpc.py"))]
    return sorted(out)


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_one_way(package):
    assert python_files(package), f"no Python files under {package}/"
    wrong = [f"{os.path.relpath(path, ROOT)}:{line} imports {name}"
             for path in python_files(package) for line, name in sorted(imported_packages(path))
             if name in FORBIDDEN[package]]
    assert not wrong, "imports that run the wrong way:\n" + "\n".join(wrong)


def test_api_imports_only_common_and_protos():
    """The HTTP API is a client of the scheduler's public gRPC API: of this repository it may use only common/
    (the client, the tokenizer) and protos/, never a service's internals."""
    ours = {name for name in os.listdir(ROOT) if os.path.isdir(os.path.join(ROOT, name, "")) and
            os.path.exists(os.path.join(ROOT, name, "__init__.py"))}
    assert {"scheduler_svc", "worker_svc", "common", "protos"} <= ours
    wrong = [f"{os.path.relpath(path, ROOT)}:{line} imports {name}"
             for path in python_files("api_svc") for line, name in sorted(imported_packages(path))
             if name in ours - {"api_svc", "common", "protos"}]
    assert not wrong, "api_svc may import only common/ and protos/ of this repository:\n" + "\n".join(wrong)


def test_scheduling_core_has_no_io_imports():
    modules = python_files(PURE_PACKAGE)
    assert {"scheduler.py", "policy.py", "request.py", "block_pool.py", "step_records.py"} <= {
        os.path.basename(m) for m in modules}
    wrong = [f"{os.path.relpath(path, ROOT)}:{line} imports {name}" for path in modules
             for line, name in sorted(imported_packages(path)) if name in IO_LIBRARIES]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("package", WIRE_FREE_PACKAGES)
def test_worker_core_imports_no_wire_format(package):
    """Only worker_svc/server.py and worker_svc/wire.py convert to and from protos/worker.proto."""
    assert python_files(package), f"no Python files under {package}/"
    wrong = [f"{os.path.relpath(path, ROOT)}:{line} imports {name}" for path in python_files(package)
             for line, name in sorted(imported_packages(path)) if name in WIRE]
    assert not wrong, "\n".join(wrong)


def test_no_product_module_is_over_the_line_limit():
    """One concept per file: a product module over 450 lines holds more than one and should be split."""
    long = []
    for package in PRODUCT_PACKAGES:
        for path in python_files(package):
            with open(path) as f:
                n = sum(1 for _ in f)
            if n > MAX_PRODUCT_LINES:
                long.append(f"{os.path.relpath(path, ROOT)}: {n} lines")
    assert not long, f"product modules over {MAX_PRODUCT_LINES} lines:\n" + "\n".join(long)


@pytest.mark.parametrize("module", CONFIG_MODULES)
def test_settings_modules_stay_light(module):
    heavy = IO_LIBRARIES | {"numpy", "fastapi", "uvicorn", "xgrammar"}
    wrong = [f"{module}:{line} imports {name}" for line, name in sorted(imported_packages(os.path.join(ROOT, module)))
             if name in heavy]
    assert not wrong, "\n".join(wrong)


def test_the_check_catches_a_wrong_way_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from llmserve.cli import main\n")
    assert (2, "llmserve") in imported_packages(str(bad))
