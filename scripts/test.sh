#!/usr/bin/env bash
# Set everything up, lint, and run the test suite: the default run leaves out the tests marked `slow` (bench smoke
# runs, chaos loops; README "Tests"). `--all` runs those too; other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
args=()
for a in "$@"; do
  if [ "$a" = "--all" ]; then export LLMSERVE_TEST_ALL=1; else args+=("$a"); fi
done
./scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/python -m pytest -q ${args[@]+"${args[@]}"}
