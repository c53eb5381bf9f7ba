#!/usr/bin/env bash
# Build deploy/docker/Dockerfile and run the image against this machine's PostgreSQL and Redis.
#
# No image registry is reachable here, so python:3.11-slim cannot be pulled: the base is made
# from Debian's packages (mmdebstrap: bookworm's python3.11, python3-venv, python-is-python3)
# and given to the build as PYTHON_IMAGE. buildah builds in the docker format (OCI's drops
# HEALTHCHECK) with the host's network (pip reaches PyPI as on the host); podman runs the image with the host's network, so the containers reach
# PostgreSQL and Redis on 127.0.0.1. It checks, in order: the build; the image's user is not
# root; `ax db upgrade`; a scheduler and a worker (with examples/demo_tasks.py mounted)
# register, serve /metrics, answer /readyz 200 and pass the image's HEALTHCHECK (/healthz); a
# task enqueued from the image runs; both stop warmly (exit 0) on `podman stop`. Root only (rootful podman); installs buildah, podman,
# runc and mmdebstrap from Debian's packages when missing. Run from anywhere:
#
#   bash deploy/docker/build_check.sh          (KEEP=1 keeps the image, the base is always kept)
set -euo pipefail
cd "$(dirname "$0")/../.."

PG_ADMIN_URL=${AX_TEST_PG_URL:-postgresql://postgres@127.0.0.1:5432/postgres}
REDIS_URL=${AX_TEST_REDIS_URL:-redis://127.0.0.1:6379/13}
BASE=localhost/ax-python-base:3.11-bookworm-2
IMAGE=localhost/ax_kombu:build-check
DB=ax_image_check_$$
SCHED=ax-check-scheduler-$$
WORKER=ax-check-worker-$$

# runc: crun refuses a hybrid cgroup v1 hierarchy (this machine's); the build's RUN steps
# need no runtime (chroot isolation)
# (podman logs, as errors, each HEALTHCHECK timer it cannot give systemd: those lines go)
pm() { podman --runtime runc "$@" 2> >(grep -v '/run/systemd/private' >&2); }
# Small limits (plenty for this check): where root lacks CAP_SYS_RESOURCE (this machine's
# sandbox) the runtime may not raise a limit above conmon's own (32768 processes here), and
# podman's defaults are higher. No systemd timer for the HEALTHCHECK (there is no systemd:
# it is run by hand below, `podman healthcheck run`).
RUN_OPTS=(--network host --ulimit nofile=4096:4096 --ulimit nproc=4096:4096)
say() { echo "build_check: $*" >&2; }
fail() { say "FAILED: $*"; exit 1; }

need=()
for tool in buildah podman runc mmdebstrap psql; do
  command -v "$tool" >/dev/null || need+=("$tool")
done
if [ ${#need[@]} -gt 0 ]; then
  say "installing ${need[*]/psql/postgresql-client}"
  timeout 120 apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -qq buildah podman runc \
    mmdebstrap uidmap postgresql-client >/dev/null
fi

cleanup() {
  pm rm -f -t 0 "$SCHED" "$WORKER" >/dev/null 2>&1 || true
  psql -q "$PG_ADMIN_URL" -c "DROP DATABASE IF EXISTS $DB" >/dev/null 2>&1 || true
  [ "${KEEP:-0}" = 1 ] || pm rmi -f "$IMAGE" >/dev/null 2>&1 || true
}
trap cleanup EXIT

# -- the base: Debian's Python 3.11, as python:3.11-slim has it (python, venv, pip's CA certs)
if ! pm image exists "$BASE"; then
  say "making the base $BASE from Debian's packages"
  # with this machine's CA bundle, and pip told to use it: the build's pip then trusts what
  # the host's pip trusts (HTTPS here may pass through a proxy whose CA only that bundle has)
  timeout 900 mmdebstrap --quiet --variant=minbase \
      --include=python3.11,python3-venv,python-is-python3,ca-certificates \
      --customize-hook='upload /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/ca-certificates.crt' \
      bookworm - \
    | pm import --change 'CMD ["python3"]' \
        --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' - "$BASE" >/dev/null \
    || fail "could not make the base image"
fi

# -- the build, exactly as docs/deploy.md says, the base swapped
say "building $IMAGE"
start=$(date +%s)
timeout 1200 buildah bud --quiet --format docker --isolation chroot --network host \
    --build-arg PYTHON_IMAGE="$BASE" \
    --ignorefile deploy/docker/Dockerfile.dockerignore \
    -f deploy/docker/Dockerfile -t "$IMAGE" . >/dev/null \
  || fail "buildah bud"
say "built in $(( $(date +%s) - start )) s, $(pm image inspect --format '{{.Size}}' "$IMAGE") bytes"

user=$(pm image inspect --format '{{.Config.User}}' "$IMAGE")
case "${user%%:*}" in ""|root|0) fail "the image runs as '$user'";; esac

# -- run it against this machine's servers
psql -q "$PG_ADMIN_URL" -c "CREATE DATABASE $DB" >/dev/null
db_url="${PG_ADMIN_URL%/*}/$DB"
run=(pm run --rm --no-healthcheck "${RUN_OPTS[@]}" -e AX_DATABASE_URL="$db_url" -e AX_BROKER_URL="$REDIS_URL")
"${run[@]}" "$IMAGE" ax db upgrade || fail "ax db upgrade"

daemon=(pm run -d --health-interval disable "${RUN_OPTS[@]}" -e AX_DATABASE_URL="$db_url" -e AX_BROKER_URL="$REDIS_URL")
"${daemon[@]}" --name "$SCHED" -e AX_METRICS_PORT=19208 "$IMAGE" \
  ax-scheduler -n "$SCHED" --metrics-port 19208 --metrics-addr 127.0.0.1 >/dev/null
"${daemon[@]}" --name "$WORKER" -e AX_METRICS_PORT=19209 \
  -v "$PWD/examples/demo_tasks.py:/app/demo_tasks.py:ro,Z" "$IMAGE" \
  ax-worker -n "$WORKER" -A demo_tasks --processes 1 --metrics-port 19209 \
  --metrics-addr 127.0.0.1 >/dev/null

until_ok() {  # until_ok SECONDS WHAT COMMAND…: poll COMMAND until it succeeds
  local deadline=$(( $(date +%s) + $1 )) what=$2; shift 2
  until "$@" >/dev/null 2>&1; do
    [ "$(date +%s)" -lt "$deadline" ] || fail "$what (no success within the deadline)"
    sleep 0.5
  done
}
until_ok 60 "the scheduler's /metrics" curl -sf http://127.0.0.1:19208/metrics
until_ok 60 "the worker's /metrics" curl -sf http://127.0.0.1:19209/metrics
until_ok 60 "the scheduler's /readyz" curl -sf http://127.0.0.1:19208/readyz
until_ok 60 "the worker's /readyz" curl -sf http://127.0.0.1:19209/readyz
for name in "$SCHED" "$WORKER"; do
  [ "$(pm exec "$name" id -u)" != 0 ] || fail "$name runs as root"
  pm healthcheck run "$name" >/dev/null || fail "$name: the image's HEALTHCHECK"
done
status=$("${run[@]}" "$IMAGE" ax status --no-broker)
grep -q "scheduler $SCHED" <<<"$status" || fail "no live scheduler in ax status: $status"
grep -q "worker    $WORKER" <<<"$status" || fail "no live worker in ax status: $status"

task=$("${run[@]}" "$IMAGE" ax enqueue coupon.grant --payload '{"user": 1}')
done_run() { "${run[@]}" "$IMAGE" ax inspect "$task" | grep -q SUCCESS; }
until_ok 60 "task $task run by the worker" done_run
say "task $task ran"

# -- a warm stop: exit 0 within the grace periods of docs/deploy.md
pm stop -t 30 "$SCHED" >/dev/null
pm stop -t 60 "$WORKER" >/dev/null
for name in "$SCHED" "$WORKER"; do
  code=$(pm inspect --format '{{.State.ExitCode}}' "$name")
  [ "$code" = 0 ] || { pm logs "$name" | tail -20 >&2; fail "$name exited $code"; }
done
say "OK: built, ran a scheduler and a worker, a task, warm stops"
