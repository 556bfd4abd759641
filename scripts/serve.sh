#!/usr/bin/env bash
# Set everything up, serve the bundled SmolLM2-135M-Instruct on 127.0.0.1:50051 (gRPC) and 127.0.0.1:8000 (the
# OpenAI-compatible HTTP API), answer a sample prompt through both, then keep serving until Ctrl-C. Extra arguments
# go to `llmserve serve`.
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
http_port=8000
args=("$@")
for i in "${!args[@]}"; do [ "${args[$i]}" = "--http-port" ] && http_port="${args[$((i + 1))]}"; done
if [ "$http_port" != "0" ]; then
  for _ in $(seq 1 60); do
    curl -sf "http://127.0.0.1:$http_port/health" >/dev/null 2>&1 && break
    sleep 1
  done
  echo "== the same through the OpenAI-compatible API:"
  echo "curl http://127.0.0.1:$http_port/v1/chat/completions -H 'Content-Type: application/json' \\"
  echo "  -d '{\"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}], \"temperature\": 0, \"max_tokens\": 64}'"
  curl -s "http://127.0.0.1:$http_port/v1/chat/completions" -H 'Content-Type: application/json' \
    -d '{"messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0, "max_tokens": 64}'
  echo
fi
echo "== serving on 127.0.0.1:50051 (gRPC) and http://127.0.0.1:$http_port/v1 (OpenAI API) (Ctrl-C to stop); try:"
echo "   .venv/bin/llmserve generate --chat 'Tell me a joke'"
wait $pid
