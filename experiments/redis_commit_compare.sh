#!/bin/bash
# The scheduler-overhead benchmark on a baseline commit and on this working tree, back to back, with the same
# measurement code on both (this tree's experiments/scheduler_overhead.py): Redis commands, bytes and commit script time
# per step, old vs new.
#
#   experiments/redis_commit_compare.sh [BASE_COMMIT] [bench flags...]     # default: 0c1ac8c, --running 16 64 256 ...
set -euo pipefail
base=${1:-0c1ac8c}
shift || true
flags=("$@")
[ ${#flags[@]} -gt 0 ] || flags=(--running 16 64 256 --warmup 10 --measure 100 --tail-tokens 150 --scheduling async
                                  --direct)
here=$(git rev-parse --show-toplevel)
tmp=$(mktemp -d)
git -C "$here" worktree add --detach -q "$tmp/base" "$base"
trap 'git -C "$here" worktree remove --force "$tmp/base"; rm -rf "$tmp"' EXIT
ln -s "$(readlink -f "$here/.venv")" "$tmp/base/.venv"
cp "$here/bench/scheduler_overhead.py" "$tmp/base/bench/scheduler_overhead.py"
for tree in "$tmp/base" "$here"; do
  echo "=== $(git -C "$tree" rev-parse --short HEAD) ($tree) $(date -u +%H:%M:%S)"
  (cd "$tree" && PYTHONPATH="$tree" .venv/bin/python -m experiments.scheduler_overhead "${flags[@]}" 2>&1 \
     | sed -n '/^| scheduling | running | Redis cmds/,$p')
done
