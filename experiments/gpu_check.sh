#!/usr/bin/env bash
# The GPU check, in one go on a CUDA machine (under 10 minutes on one H200): set-up, the GPU tests, the kernel
# benchmark and a serving benchmark of a 1B-class random-weight Llama in bfloat16 at batch 1, 16, 64 and 256.
#
#   bash experiments/gpu_check.sh                 # results in experiments/out/gpu_check/ (or in $OUT when it is set)
#   PYTHON=/path/to/python bash experiments/gpu_check.sh
#
# Set-up: the python in $PYTHON (default: .venv/bin/python, else python3) must already have torch's CUDA build
# (this script never installs torch: an unpinned pip install would pick whatever build the index has). The project is
# installed editable without touching torch; its other dependencies are installed only when an import fails.
# Each stage has its own time limit and a failed stage does not stop the next; the results file says what ran, how
# long it took and how it ended, then the stages' own output. Exit status: 0 when every stage passed.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
RESULTS_DIR=${OUT:-$REPO/experiments/out/gpu_check}
mkdir -p "$RESULTS_DIR"
RESULTS=$RESULTS_DIR/gpu_check.md
LOGS=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
# Stage limits (seconds); the sum stays under 10 minutes with the set-up.
T_SETUP=${T_SETUP:-90} T_TESTS=${T_TESTS:-210} T_KERNELS=${T_KERNELS:-120} T_SERVE=${T_SERVE:-170}

status=0
summary=()
stage() {  # stage NAME LIMIT_S COMMAND...: run with a time limit, log to $LOGS/NAME.log, record the outcome
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS rc
  echo "== $name (limit ${limit}s): $*" >&2
  timeout --kill-after=10 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  rc=$?
  local verdict=passed
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then verdict="timed out"; elif [ $rc -ne 0 ]; then verdict="failed ($rc)"; fi
  [ "$verdict" = passed ] || status=1
  summary+=("| $name | $verdict | $((SECONDS - t0)) s | \`$*\` |")
  echo "   $verdict in $((SECONDS - t0)) s" >&2
}

setup() {
  "$PY" -c 'import torch, sys; ok = torch.cuda.is_available(); print(torch.__version__, torch.version.cuda, ok and torch.cuda.get_device_name(0)); sys.exit(0 if ok else 3)' || {
    echo "no CUDA device through $PY (torch with CUDA is needed)"; return 3; }
  "$PY" -m pip install -q --no-deps -e . || return $?
  if ! "$PY" -c 'import llmserve, grpc, redis, tokenizers, safetensors, gguf, fastapi, uvicorn, httpx, msgpack, xgrammar, triton, transformers, pytest, psutil, tqdm' 2>/dev/null; then
    "$PY" -m pip install -q -e '.[worker,test,bench]' || return $?  # torch is already there: pip keeps it
  fi
  command -v redis-server >/dev/null || { echo "redis-server is missing (apt-get install redis-server)"; return 4; }
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
}

gpu_tests() {
  # Whatever GPU test files exist: the Triton kernels (on the device when CUDA is there), the compiled forward with
  # CUDA graph replays against the eager one (test_cuda_graphs.py), the quantized GEMMs. The other compiled-forward
  # tests run on the CPU (the default test run has them). Missing ones are skipped; none at all is a failure.
  local files=()
  for pattern in 'test_triton*.py' 'test_cuda_graph*.py' 'test_*cudagraph*.py' 'test_quant*.py' 'test_*gemm*.py'; do
    while IFS= read -r f; do files+=("$f"); done < <(find tests -name "$pattern" -type f | sort)
  done
  if [ ${#files[@]} -eq 0 ]; then echo "no GPU test files found"; return 5; fi
  mapfile -t files < <(printf '%s\n' "${files[@]}" | sort -u)
  echo "test files: ${files[*]}"
  "$PY" -m pytest -q -x -p no:cacheprovider "${files[@]}"
}

export PY
export -f setup gpu_tests  # `timeout` runs commands, not functions: the stages below run them through bash -c
stage setup "$T_SETUP" bash -c setup
if [ $status -eq 0 ]; then
  stage gpu_tests "$T_TESTS" bash -c gpu_tests
  stage kernels "$T_KERNELS" "$PY" -m experiments.kernels_gpu --json "$RESULTS_DIR/kernels_gpu.json"
  stage serve "$T_SERVE" "$PY" -m experiments.gpu_serve --batch-sizes 1,16,64,256 --dtype bfloat16 --device cuda \
    --json "$RESULTS_DIR/gpu_serve.json"
fi

{
  echo "# GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ), $(git rev-parse --short HEAD 2>/dev/null)"
  echo
  echo "| stage | result | time | command |"
  echo "|---|---|---|---|"
  printf '%s\n' "${summary[@]}"
  for log in setup gpu_tests kernels serve; do
    [ -f "$LOGS/$log.log" ] || continue
    echo
    echo "## $log (last 150 lines)"
    echo
    echo '```'
    tail -n 150 "$LOGS/$log.log"
    echo '```'
  done
} >"$RESULTS"
echo "results: $RESULTS" >&2
exit $status
