#!/usr/bin/env bash
# Set up .venv (once) and run the main job on the embedded default: examples/demo.py
# starts ax-scheduler and ax-worker with no configuration (SQLite + SQLite transport).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
log=$(mktemp)
.venv/bin/python -m pip install -q --disable-pip-version-check -e . >"$log" 2>&1 \
  || { cat "$log"; exit 1; }
rm -f "$log"
exec .venv/bin/python examples/demo.py
