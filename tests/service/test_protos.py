"""The committed generated modules in protos/ equal a fresh generation with the documented command."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def _generated_names(directory: str) -> set[str]:
    return {f for f in os.listdir(directory) if f.endswith(GENERATED_SUFFIXES)}


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> str:
    """Run protos/README.md's command from the repo root, writing into a temp dir; return its protos/ folder."""
    pytest.importorskip("grpc_tools", reason="grpcio-tools (the [test] extra) is needed to regenerate the protos")
    out = str(tmp_path_factory.mktemp("protos_out"))
    protos = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "protos", "*.proto")))
    assert protos, "no .proto files under protos/"
    cmd = [sys.executable, "-m", "grpc_tools.protoc", "-I", ".", f"--python_out={out}", f"--pyi_out={out}",
           f"--grpc_python_out={out}", *protos]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"protoc failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return os.path.join(out, "protos")


def test_every_proto_has_committed_modules_and_nothing_extra(fresh):
    committed = _generated_names(os.path.join(ROOT, "protos"))
    generated = _generated_names(fresh)
    stems = {os.path.basename(p)[: -len(".proto")] for p in glob.glob(os.path.join(ROOT, "protos", "*.proto"))}
    assert generated == {s + suffix for s in stems for suffix in GENERATED_SUFFIXES}
    assert committed == generated, (f"missing from protos/: {sorted(generated - committed)}; "
                                    f"stale in protos/: {sorted(committed - generated)}")


def test_committed_modules_are_byte_identical_to_fresh_generation(fresh):
    stale = []
    for name in sorted(_generated_names(fresh)):
        committed = Path(ROOT, "protos", name)
        if not committed.is_file() or committed.read_bytes() != Path(fresh, name).read_bytes():
            stale.append(name)
    assert not stale, (f"protos/{', protos/'.join(stale)} differ from a fresh generation; regenerate with the "
                       "command in protos/README.md")
