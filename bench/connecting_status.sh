#!/usr/bin/env bash
# Issue 44, item 2: how long after `ftd serve` starts does a plain `ftd status` (found through
# the registry, no flag) say that the node is connecting, with the last error and the time left,
# for an endpoint whose name does not resolve? Five runs; each line: seconds, and the line seen.
#   bash bench/connecting_status.sh        (from the repository root, after `make test`'s set-up)
set -u
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export XDG_RUNTIME_DIR="$work/runtime" PYTHONPATH=".:client"
mkdir -m 700 "$XDG_RUNTIME_DIR"
printf 'print("never runs")\n' > "$work/train.py"
for run in 1 2 3 4 5; do
  rm -rf "$work/logs"
  started=$(date +%s.%N)
  .venv/bin/python -m ftd serve --nnodes 2 --rdzv-endpoint nonexistent.invalid:29400 \
    --node-id a --log-dir "$work/logs" "$work/train.py" > "$work/serve.log" 2>&1 &
  daemon=$!
  while ! line=$(.venv/bin/python -m ftd status 2>/dev/null | grep '^connecting to .*tries)'); do :; done
  seen=$(date +%s.%N)
  echo "run $run: $(python3 -c "print(f'{$seen - $started:.2f}')") s: $line"
  kill -TERM "$daemon"; wait "$daemon"
done
