#!/usr/bin/env bash
# Start the local servers if they are stopped, set up .venv (once) and run the whole
# test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/services.sh start || echo "test.sh: a server is missing; its tests will be skipped" >&2
[ -x .venv/bin/python ] || python3 -m venv .venv
log=$(mktemp)
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]' >"$log" 2>&1 \
  || { cat "$log"; exit 1; }
rm -f "$log"
exec .venv/bin/python -m pytest "$@"
