#!/usr/bin/env bash
# Set everything up, lint, and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/python -m pytest -q "$@"
