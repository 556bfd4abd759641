"""The Dockerfile's torch variants, read as a builder reads them (no build: a CUDA torch is gigabytes and PyTorch's
index is out of reach here): each TORCH_VARIANT names PyTorch's index of that build and the image's label, torch
alone comes from there at the constraints' version, the server stages install no torch; scripts/build_image.sh
refuses a variant PyTorch does not publish and a wheel directory without that build before it builds anything.
tests/e2e/test_image.py (slow) builds and starts the CPU variant."""

from __future__ import annotations

import os
import re
import shlex
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCKERFILE = os.path.join(ROOT, "Dockerfile")
BUILD_IMAGE = os.path.join(ROOT, "scripts", "build_image.sh")


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined and comments dropped, as a builder parses them."""
    out, pending = [], ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        word, _, rest = pending.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        pending = ""
    return out


def expand(value: str, env: dict[str, str]) -> str:
    """A builder's `${NAME}` / `$NAME` substitution (unset names become empty)."""
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: env.get(m.group(1) or m.group(2), ""), value)


def stages(build_args: dict[str, str]) -> dict[str, dict]:
    """Per stage: its ARG values (declared in that stage, defaults overridden by `build_args`), its LABELs and
    RUN lines, and its parent stage."""
    result: dict[str, dict] = {}
    current: dict | None = None
    for word, rest in instructions(open(DOCKERFILE).read()):
        if word == "FROM":
            parent, _, name = rest.partition(" AS ")
            current = result[name.strip()] = {"parent": parent.strip(), "args": {}, "labels": {}, "runs": []}
        elif current is None:
            continue  # global ARGs: only FROM lines see them
        elif word == "ARG":
            name, _, default = rest.partition("=")
            current["args"][name] = build_args.get(name, expand(default, current["args"]))
        elif word == "LABEL":
            for pair in shlex.split(rest):
                key, _, value = pair.partition("=")
                current["labels"][key] = expand(value, current["args"])
        elif word == "RUN":
            current["runs"].append(rest)
    return result


def torch_install(stage: dict) -> list[str]:
    """The words of the stage's pip install that fetches torch from TORCH_INDEX_URL."""
    for run in stage["runs"]:
        for command in run.split("&&"):
            words = shlex.split(command)
            if "--index-url" in words:
                return [expand(w, stage["args"]) for w in words]
    raise AssertionError("no pip install with --index-url in the stage")


@pytest.mark.parametrize("variant", ["cpu", "cu126", "cu128", "cu130", "rocm6.4", "xpu"])
def test_each_variant_names_pytorchs_index_of_that_build(variant):
    worker_deps = stages({"TORCH_VARIANT": variant})["worker-deps"]
    index = f"https://download.pytorch.org/whl/{variant}"
    assert worker_deps["args"]["TORCH_INDEX_URL"] == index
    assert worker_deps["labels"]["io.llmserve.torch-variant"] == variant
    words = torch_install(worker_deps)
    assert words[words.index("--index-url") + 1] == index
    # torch alone from that index, at the version the tests passed with; its dependencies come pinned from PyPI
    assert "--no-deps" in words and words[words.index("-c") + 1] == "scripts/constraints.txt"
    assert words[-1] == "torch"


def test_the_default_is_the_cpu_build_and_a_local_index_replaces_pytorchs():
    assert stages({})["worker-deps"]["args"]["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    local = stages({"TORCH_VARIANT": "cu128", "TORCH_INDEX_URL": "file:///torch-index"})["worker-deps"]
    assert torch_install(local)[torch_install(local).index("--index-url") + 1] == "file:///torch-index"
    assert local["labels"]["io.llmserve.torch-variant"] == "cu128"


def test_constraints_pin_torch_and_the_server_stages_install_none():
    pins = open(os.path.join(ROOT, "scripts", "constraints.txt")).read()
    assert re.search(r"^torch==\d+\.\d+\.\d+$", pins, re.M)
    all_stages = stages({"TORCH_VARIANT": "cu128"})
    assert all_stages["worker"]["parent"] == "worker-deps" and all_stages["server"]["parent"] == "server-deps"
    for name in ("server-deps", "server"):
        assert not any(re.search(r"\btorch\b", run) for run in all_stages[name]["runs"]), name


def build_image(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([BUILD_IMAGE, *args], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "PODMAN": "false"})  # nothing may reach podman


def test_build_script_refuses_a_variant_pytorch_does_not_publish():
    proc = build_image("--torch-variant", "cuda12.8")
    assert proc.returncode == 2 and "--torch-variant: 'cuda12.8' is not a PyTorch build" in proc.stderr


def test_build_script_wants_the_variants_wheel_before_building(tmp_path):
    (tmp_path / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    proc = build_image("--torch-variant", "cu128", "--torch-wheels", str(tmp_path))
    assert proc.returncode == 2 and f"no torch-*+cu128-*.whl in {tmp_path}" in proc.stderr, proc.stderr
    assert "==" not in proc.stdout  # refused before the base or an image was built
    missing = build_image("--torch-wheels", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "--torch-wheels: no directory" in missing.stderr
