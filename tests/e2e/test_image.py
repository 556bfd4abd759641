"""The Dockerfile's images, built by scripts/build_image.sh with podman (kept when their inputs have not changed) and
started without a container runtime: each image's filesystem (a created, never started, container's, so a writable
copy) is entered with chroot in a private mount namespace, with the image's environment, working directory and
entrypoint, on the host's network. The worker image runs `llmserve serve` of the bundled SmolLM2 (its own
redis-server inside) and answers a chat request from the host with Hugging Face's greedy tokens; the server image
has no torch, and its HTTP API in front of that scheduler gives the same answer. (slow: the first build takes
about 10 minutes on 2 cores; podman and mmdebstrap are Debian packages.)"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import torch

from tests.support import cluster

pytestmark = pytest.mark.slow

ROOT = cluster.ROOT
TAG = "test"
SERVER, WORKER = f"llmserve:{TAG}", f"llmserve-worker:{TAG}"
BUILD_TIMEOUT_S = 3600
START_TIMEOUT_S = 600  # the worker compiles its C++ kernels on first start, then loads and warms up
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 12


def podman(*args: str, timeout: float = 300) -> str:
    proc = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"podman {' '.join(args)}: {proc.stderr}"
    return proc.stdout.strip()


def cpu_torch_wheel(dest: str) -> str:
    """The CPU build of the torch this venv has, as a wheel in `dest`: from pip's configured indexes (a local
    wheelhouse) or else PyTorch's CPU index; the image gets the same torch the tests pass with."""
    version = importlib.metadata.version("torch").split("+")[0]
    base = [sys.executable, "-m", "pip", "download", "--no-deps", "--dest", dest, f"torch=={version}+cpu"]
    for extra in ([], ["--extra-index-url", "https://download.pytorch.org/whl/cpu"]):
        proc = subprocess.run(base + extra, capture_output=True, text=True, timeout=1800)
        if proc.returncode == 0:
            return dest
    pytest.fail(f"no CPU wheel of torch {version} from pip: {proc.stderr[-2000:]}")


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> str:
    """Both images built (or found up to date); the build script's last line: its time and the images' sizes."""
    missing = [tool for tool in ("podman", "mmdebstrap", "unshare", "chroot") if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"missing {', '.join(missing)}: apt-get install podman mmdebstrap")
    wheels = cpu_torch_wheel(str(tmp_path_factory.mktemp("torch-wheels")))
    proc = subprocess.run([os.path.join(ROOT, "scripts", "build_image.sh"), "--torch-wheels", wheels, "--tag", TAG],
                          capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = proc.stdout.strip().splitlines()[-1]
    print(f"\n{summary}")
    return summary


@contextmanager
def image_root(image: str) -> Iterator[tuple[str, dict]]:
    """The filesystem of a created container of `image` (never started: podman's runtime is not needed) and the
    image's config (Env, WorkingDir, Entrypoint); the container is removed afterwards."""
    config = json.loads(podman("image", "inspect", "--format", "{{json .Config}}", image))
    cid = podman("create", image)
    try:
        yield podman("mount", cid), config
    finally:
        subprocess.run(["podman", "umount", cid], capture_output=True, timeout=120)
        subprocess.run(["podman", "rm", "-f", cid], capture_output=True, timeout=300)


def in_image(root: str, config: dict, args: list, entrypoint: bool = True) -> list[str]:
    """argv that runs `args` inside the image's filesystem as `podman run` would: the image's environment only, its
    working directory, its entrypoint first; /proc, /dev and /sys bound in a private mount namespace (gone with the
    process), the host's network shared."""
    binds = " && ".join(f"mount --rbind /{d} \"$0/{d}\"" for d in ("proc", "dev", "sys"))
    command = [*(config.get("Entrypoint") or [] if entrypoint else []), *map(str, args)]
    return ["unshare", "--mount", "--fork", "--", "sh", "-c",
            f"{binds} && exec chroot \"$0\" /usr/bin/env -i -C \"{config.get('WorkingDir') or '/'}\" \"$@\"",
            root, *config.get("Env", []), *command]


@contextmanager
def started(argv: list[str], log_path: str) -> Iterator[subprocess.Popen]:
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        for sig, wait_s in ((signal.SIGTERM, 60), (signal.SIGKILL, 30)):
            if proc.poll() is not None:
                break
            os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                pass


def wait_http_health(port: int, proc: subprocess.Popen, log_path: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        tail = open(log_path, errors="replace").read()[-4000:]
        assert proc.poll() is None, f"exited with {proc.returncode}:\n{tail}"
        assert time.monotonic() < deadline, f"no healthy /health on {port} after {START_TIMEOUT_S} s:\n{tail}"
        time.sleep(1)


def chat(port: int) -> dict:
    response = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120,
                          json={"messages": CHAT, "temperature": 0, "max_tokens": MAX_TOKENS})
    assert response.status_code == 200, response.text
    return response.json()


def hf_chat_reference(hf_model, hf_tokenizer) -> tuple[int, str]:
    """The prompt's length and the greedy answer of transformers (float32) on the same GGUF and chat template."""
    rendered = hf_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=True)
    ids = list(rendered["input_ids"])
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
    return len(ids), hf_tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)


def test_images_serve_the_bundled_model_and_the_server_image_has_no_torch(images, tmp_path, hf_model, hf_tokenizer):
    labels = json.loads(podman("image", "inspect", "--format", "{{json .Labels}}", WORKER))
    assert labels["io.llmserve.torch-variant"] == "cpu"
    prompt_len, reference = hf_chat_reference(hf_model, hf_tokenizer)
    grpc_port, http_port, api_port = cluster.free_port(), cluster.free_port(), cluster.free_port()
    with image_root(WORKER) as (worker_root, worker_cfg), image_root(SERVER) as (server_root, server_cfg):
        torch_version = subprocess.run(in_image(worker_root, worker_cfg, ["python", "-c",
                                                                          "import torch; print(torch.__version__)"],
                                                entrypoint=False), capture_output=True, text=True, timeout=300)
        assert re.fullmatch(r"\d+\.\d+\.\d+\+cpu", torch_version.stdout.strip()), torch_version.stderr
        no_torch = subprocess.run(in_image(server_root, server_cfg, ["python", "-c", "import torch"], entrypoint=False),
                                  capture_output=True, text=True, timeout=300)
        assert no_torch.returncode != 0 and "No module named 'torch'" in no_torch.stderr, no_torch.stderr

        serve_log = str(tmp_path / "serve.log")
        # float32 as the reference (`--dtype auto` is bfloat16 on a CPU with AVX512-BF16 or AMX)
        serve = in_image(worker_root, worker_cfg, ["serve", "--device", "cpu", "--dtype", "float32",
                                                   "--port", grpc_port, "--http-port", http_port,
                                                   "--num-gpu-blocks-override", 64])
        with started(serve, serve_log) as serve_proc:
            wait_http_health(http_port, serve_proc, serve_log)
            answer = chat(http_port)
            assert answer["usage"]["prompt_tokens"] == prompt_len
            assert answer["choices"][0]["message"]["content"] == reference, (answer, reference)

            # The server image: its health check and its HTTP API in front of the worker image's scheduler.
            health = subprocess.run(in_image(server_root, server_cfg, ["health", "--address",
                                                                      f"127.0.0.1:{grpc_port}"]),
                                    capture_output=True, text=True, timeout=120)
            assert health.returncode == 0, health.stdout + health.stderr
            api_log = str(tmp_path / "api.log")
            api = in_image(server_root, server_cfg, ["api", "--host", "127.0.0.1", "--port", api_port,
                                                     "--scheduler", f"127.0.0.1:{grpc_port}"])
            with started(api, api_log) as api_proc:
                wait_http_health(api_port, api_proc, api_log)
                again = chat(api_port)
                assert again["choices"][0]["message"]["content"] == reference, (again, reference)
