#!/usr/bin/env bash
# Set everything up, serve the bundled SmolLM2-135M-Instruct on 127.0.0.1:50051, answer a sample prompt,
# then keep serving until Ctrl-C. Extra arguments go to `llmserve serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/llmserve serve --port 50051 "$@" &
pid=$!
trap 'kill -INT $pid 2>/dev/null; wait $pid 2>/dev/null' EXIT INT TERM
for _ in $(seq 1 300); do
  .venv/bin/llmserve health --address 127.0.0.1:50051 >/dev/null 2>&1 && break
  kill -0 $pid 2>/dev/null || { echo "llmserve serve exited"; exit 1; }
  sleep 1
done
echo "== sample prompt: What is the capital of France?"
.venv/bin/llmserve generate --server 127.0.0.1:50051 --chat --temperature 0 --max-tokens 64 "What is the capital of France?"
echo "== serving on 127.0.0.1:50051 (Ctrl-C to stop); try: .venv/bin/llmserve generate --chat 'Tell me a joke'"
wait $pid
