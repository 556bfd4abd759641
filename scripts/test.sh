#!/usr/bin/env bash
# Set everything up, lint, and run the tests. Three tiers (README, "Tests"): tests/unit (pure), tests/service (one part
# at a time, in this process where it can be) and tests/e2e (real processes end to end).
#   ./scripts/test.sh            every tier, leaving out the tests marked `slow` (bench smoke runs, chaos loops)
#   ./scripts/test.sh --fast     tests/unit and tests/service only, leaving out the `heavy` ones too (LLMSERVE_TEST_FAST=1):
#                                the run a developer repeats all day
#   ./scripts/test.sh --all      the `slow` tests too (LLMSERVE_TEST_ALL=1)
# Other arguments go to pytest. The tests run in LLMSERVE_TEST_PROCESSES pytest processes (default 3; 1: in this
# one), each taking whole files (a module's shared servers stay with it): a test spends much of its time waiting on
# the processes it started, and two processes left the 2-core box about 10% idle.
set -euo pipefail
cd "$(dirname "$0")/.."
args=()
paths=()
for a in "$@"; do
  case "$a" in
    --all) export LLMSERVE_TEST_ALL=1 ;;
    --fast) paths=(tests/unit tests/service); export LLMSERVE_TEST_FAST=1 ;;
    *) args+=("$a") ;;
  esac
done
./scripts/setup.sh
# The kernel tests' second ISA tier (tests/support/cpu_tiers.py) is a build of its own: made here, beside setup's
# first, so that no test waits on a compiler (cached in ~/.cache/llmserve/cpu_ops like the first).
.venv/bin/python -c "from kernels import cpu_ops; from tests.support.cpu_tiers import kernel_test_tiers
for t in kernel_test_tiers(): cpu_ops.load(t)"
.venv/bin/ruff check .
processes="${LLMSERVE_TEST_PROCESSES:-3}"
parallel=()
if [ "$processes" -gt 1 ]; then parallel=(-n "$processes" --dist loadfile); fi
.venv/bin/python -m pytest -q ${parallel[@]+"${parallel[@]}"} ${paths[@]+"${paths[@]}"} ${args[@]+"${args[@]}"}
