#!/usr/bin/env bash
# Prove the plain install works (CI runs this before the test suite):
#   1. a fresh virtualenv with `pip install <repo>`: not editable, no extras, no test tools
#      (pytest would bring e.g. `packaging` along and hide a missing dependency);
#   2. a fresh PostgreSQL database (one per broker) upgraded with `ax db upgrade`;
#   3. for Redis and for RabbitMQ: one ax-scheduler and one ax-worker from that venv,
#      100 tasks due 2 s after enqueue, all SUCCESS within 60 s;
#   4. the README's main job (examples/demo.py: SQLite store + SQLite transport, no settings).
# Needs PostgreSQL, Redis and RabbitMQ on 127.0.0.1 (scripts/services.sh start) and root for
# rabbitmqctl. Everything it creates (database, vhost, Redis keys, processes, temp dir) is
# removed at exit. Every wait is a poll with a deadline; a passing run takes about 30 s.
set -euo pipefail
LC_NUMERIC=C

REPO=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
N=100
RUN_ID="$$_$(date +%s)_$RANDOM"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/ax-install-check.XXXXXX")
BIN=$WORK/venv/bin
VPY=$BIN/python
PG=(psql -h 127.0.0.1 -p 5432 -U postgres -v ON_ERROR_STOP=1 -qtAX)
DBS=() VHOSTS=() PREFIXES=() PIDS=() LOGS=() STOP_CODES=""

# only what this script sets reaches the installed code
while read -r var; do unset "$var"; done < <(compgen -e | grep '^AX_' || true)
unset PYTHONPATH PYTHONHOME
cd "$WORK"

say() { printf 'install_check: %s\n' "$*"; }
since() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }

fail() {
  say "FAILED: $*"
  local log
  for log in "${LOGS[@]}"; do
    printf '%s\n' "----- $(basename "$log") (last 80 lines) -----"
    tail -n 80 "$log" || true
  done
  exit 1
}

stop_daemons() {  # SIGTERM (warm shutdown), SIGKILL after 20 s; fails unless all exit 0
  local pid code rc=0 deadline
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do
    deadline=$((SECONDS + 20))
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && { kill -KILL "$pid" 2>/dev/null || true; rc=1; }
    code=0
    wait "$pid" || code=$?
    [ "$code" = 0 ] || rc=1
    STOP_CODES+="$code "
  done
  PIDS=()
  return "$rc"
}

cleanup() {
  local rc=$? name
  set +e
  trap - EXIT INT TERM
  [ "${#PIDS[@]}" = 0 ] || stop_daemons >/dev/null 2>&1
  for name in "${DBS[@]}"; do
    "${PG[@]}" -d postgres -c "DROP DATABASE IF EXISTS \"$name\" WITH (FORCE)" >/dev/null
  done
  for name in "${VHOSTS[@]}"; do timeout 60 rabbitmqctl -q delete_vhost "$name" >/dev/null; done
  for name in "${PREFIXES[@]}"; do
    timeout 30 redis-cli -h 127.0.0.1 --scan --pattern "$name*" \
      | timeout 30 xargs -r redis-cli -h 127.0.0.1 del >/dev/null
  done
  rm -rf "$WORK"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

started=$EPOCHREALTIME

# --- 1. plain install -------------------------------------------------------------------
# pip builds a local directory in place (build/, *.egg-info): build from a copy of the
# checkout's files (tracked and untracked-but-not-ignored) so the checkout stays untouched.
t=$EPOCHREALTIME
mkdir "$WORK/src"
if git -C "$REPO" rev-parse --git-dir >/dev/null 2>&1; then
  git -C "$REPO" ls-files -z --cached --others --exclude-standard \
    | (cd "$REPO" && tar --null --ignore-failed-read -T - -cf - 2>/dev/null) \
    | tar -C "$WORK/src" -xf -
else
  tar -C "$REPO" --exclude=./.git --exclude=./.venv -cf - . | tar -C "$WORK/src" -xf -
fi
"$PYTHON" -m venv "$WORK/venv"
timeout 180 "$VPY" -m pip install --no-input -q --disable-pip-version-check "$WORK/src" \
  >"$WORK/pip.log" 2>&1 || { LOGS=("$WORK/pip.log"); fail "pip install <repo> failed"; }
where=$("$VPY" -c 'import ax_kombu; print(ax_kombu.__file__)')
case $where in "$WORK/venv/"*) ;; *) fail "ax_kombu imported from $where, not the venv" ;; esac
for exe in ax ax-scheduler ax-worker; do
  [ -x "$BIN/$exe" ] || fail "pip install did not create the $exe command"
done
say "install: pip install <repo> into a fresh venv ($("$VPY" -m pip list --format=freeze \
  2>/dev/null | wc -l) distributions, no extras) in $(since "$t") s"

# --- 2 + 3. PostgreSQL store, one scheduler and one worker per broker ----------------------
psql_db() { "${PG[@]}" -d "$DB" -c "$1"; }

alive_or_fail() {  # name
  local pid
  for pid in "${PIDS[@]}"; do
    kill -0 "$pid" 2>/dev/null || fail "$1: a daemon exited early (pid $pid)"
  done
}

check_broker() {  # name broker-url
  local name=$1 t counts ok total bad late
  DB="ax_install_${name}_$RUN_ID"
  DBS+=("$DB")
  "${PG[@]}" -d postgres -c "CREATE DATABASE \"$DB\"" >/dev/null || fail "$name: CREATE DATABASE"
  export AX_DATABASE_URL="postgresql://postgres@127.0.0.1:5432/$DB" AX_BROKER_URL=$2
  LOGS=("$WORK/$name-db.log")
  timeout 60 "$BIN/ax" db upgrade >"$WORK/$name-db.log" 2>&1 || fail "$name: ax db upgrade"
  say "$name: fresh database $DB, ax db upgrade:" \
    "$(sed -n 's/.* is at revision /revision /p' "$WORK/$name-db.log")"

  LOGS=("$WORK/$name-scheduler.log" "$WORK/$name-worker.log")
  "$BIN/ax-scheduler" -n "install-check-scheduler-$name" -l INFO \
    </dev/null >"$WORK/$name-scheduler.log" 2>&1 &
  PIDS+=("$!")
  PYTHONPATH="$REPO/scripts" "$BIN/ax-worker" -Q high,default,slow -A install_check_tasks \
    -n "install-check-worker-$name" -l INFO </dev/null >"$WORK/$name-worker.log" 2>&1 &
  PIDS+=("$!")
  t=$SECONDS
  until [ "$(psql_db "SELECT count(*) FROM ax_node")" -ge 2 ]; do  # a fresh database
    alive_or_fail "$name"
    ((SECONDS - t < 30)) || fail "$name: scheduler and worker not registered within 30 s"
    sleep 0.2
  done

  t=$EPOCHREALTIME
  LOGS+=("$WORK/$name-enqueue.log")
  N=$N timeout 30 "$VPY" - >"$WORK/$name-enqueue.log" 2>&1 <<'EOF' || fail "$name: enqueue"
import os
import ax_kombu as ax

n = int(os.environ["N"])
priorities = ("high", "default", "slow")
ids = ax.enqueue_many([{"task_type": "install.check", "payload": {"n": i}, "delay": 2,
                        "priority": priorities[i % 3]} for i in range(n)])
assert len(set(ids)) == n and all(i.created for i in ids), ids
EOF
  local deadline=$((SECONDS + 60))
  while :; do
    counts=$(psql_db "SELECT count(*) FILTER (WHERE status = 'SUCCESS'), count(*),
      count(*) FILTER (WHERE status IN ('FAILED', 'CANCELLED')),
      coalesce(max(started_at - trigger_time), 0) FROM ax_task")
    IFS='|' read -r ok total bad late <<<"$counts"
    [ "$total" = "$N" ] || fail "$name: $total tasks in the database, expected $N"
    [ "$ok" = "$N" ] && break
    [ "$bad" = 0 ] || fail "$name: $bad tasks FAILED or CANCELLED"
    alive_or_fail "$name"
    ((SECONDS < deadline)) || fail "$name: only $ok/$N SUCCESS after 60 s"
    sleep 0.2
  done
  say "$name: $ok/$N SUCCESS in $(since "$t") s (due 2 s after enqueue; latest start" \
    "${late} ms after due)"
  STOP_CODES=""
  stop_daemons || fail "$name: scheduler and worker did not stop warm (exit codes $STOP_CODES)"
  say "$name: scheduler and worker stopped warm (exit codes ${STOP_CODES% })"
  unset AX_DATABASE_URL AX_BROKER_URL AX_BROKER_KEY_PREFIX
}

prefix="ax-install-$RUN_ID:"
PREFIXES+=("$prefix")
export AX_BROKER_KEY_PREFIX=$prefix
check_broker redis "redis://127.0.0.1:6379/0"

vhost="ax_install_$RUN_ID"
LOGS=("$WORK/rabbitmqctl.log")
timeout 100 rabbitmqctl -q await_startup --timeout 90 >"$WORK/rabbitmqctl.log" 2>&1 \
  || fail "rabbitmq: the rabbit app is not running (rabbitmqctl await_startup)"
VHOSTS+=("$vhost")
timeout 60 rabbitmqctl -q add_vhost "$vhost" >"$WORK/rabbitmqctl.log" 2>&1 \
  || fail "rabbitmq: rabbitmqctl add_vhost $vhost"
timeout 60 rabbitmqctl -q set_permissions -p "$vhost" guest ".*" ".*" ".*" \
  >"$WORK/rabbitmqctl.log" 2>&1 || fail "rabbitmq: rabbitmqctl set_permissions"
check_broker rabbitmq "amqp://guest:guest@127.0.0.1:5672/$vhost"

# --- 4. the README's main job, from the same venv ----------------------------------------
t=$EPOCHREALTIME
LOGS=("$WORK/demo.log")
code=0
# its temp folder (store, broker, daemons' logs) goes under $WORK, removed at exit
TMPDIR=$WORK timeout 150 "$VPY" "$REPO/examples/demo.py" </dev/null >"$WORK/demo.log" 2>&1 \
  || code=$?
LOGS+=("$WORK"/ax-demo-*/*.log)
[ "$code" = 0 ] || fail "demo: examples/demo.py exited $code (124: timed out after 150 s)"
summary=$(grep -E '^[0-9]+/[0-9]+ tasks SUCCESS$' "$WORK/demo.log" | tail -n 1 || true)
[[ $summary =~ ^([0-9]+)/([0-9]+)\ tasks ]] && [ "${BASH_REMATCH[1]}" = "${BASH_REMATCH[2]}" ] \
  || fail "demo: exited 0 but printed no all-SUCCESS line"
say "demo: examples/demo.py exited 0 in $(since "$t") s ($summary)"

say "all stages passed in $(since "$started") s"
