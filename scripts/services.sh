#!/usr/bin/env bash
# Start the servers the integration tests use, if they are not already up:
# PostgreSQL 127.0.0.1:5432, Redis 127.0.0.1:6379, RabbitMQ 127.0.0.1:5672.
# Works on a Debian machine where they are installed but stopped; as root it
# installs a missing one with apt-get. Usage: scripts/services.sh [start|status]
set -uo pipefail

up() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

wait_port() {  # name port seconds
  local deadline=$((SECONDS + $3))
  until up "$2"; do
    if ((SECONDS > deadline)); then echo "services: $1 did not come up on port $2" >&2; return 1; fi
    sleep 0.5
  done
  echo "services: $1 is up on 127.0.0.1:$2"
}

ensure_pkg() {  # command package
  command -v "$1" >/dev/null 2>&1 && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "services: installing $2"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$2") >/dev/null
  fi
  command -v "$1" >/dev/null 2>&1 || { echo "services: $1 not found; install $2" >&2; return 1; }
}

start_postgres() {
  up 5432 && { echo "services: PostgreSQL is up on 127.0.0.1:5432"; return 0; }
  ensure_pkg pg_ctlcluster postgresql || return 1
  local version
  version=$(ls /etc/postgresql | sort -V | tail -n 1)
  pg_ctlcluster --skip-systemctl-redirect "$version" main start || return 1
  wait_port PostgreSQL 5432 60
}

start_redis() {
  up 6379 && { echo "services: Redis is up on 127.0.0.1:6379"; return 0; }
  ensure_pkg redis-server redis-server || return 1
  mkdir -p /var/lib/redis /var/log/redis 2>/dev/null
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log || return 1
  wait_port Redis 6379 30
}

start_rabbitmq() {
  up 5672 && { echo "services: RabbitMQ is up on 127.0.0.1:5672"; return 0; }
  ensure_pkg rabbitmq-server rabbitmq-server || return 1
  rabbitmq-server -detached || return 1
  timeout 120 rabbitmqctl await_startup >/dev/null 2>&1
  wait_port RabbitMQ 5672 120
}

# libfaketime, for the fault suite's wall-clock steps (those tests skip, saying so, without it)
ensure_faketime() {
  [ -e /usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1 ] || ls /usr/lib/*/faketime/libfaketime.so.1 \
    >/dev/null 2>&1 || ensure_pkg faketime faketime || echo "services: faketime missing" >&2
}

# promtool, for tests/unit/test_monitoring.py (`promtool check/test rules` on deploy/; those
# tests skip, saying so, without it). Debian ships it only in the `prometheus` package; the
# server it also brings is not started here (and with a policy-rc.d denying starts, not at all).
ensure_promtool() {
  command -v promtool >/dev/null 2>&1 && return 0
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "services: promtool missing and cannot install it (needs root and apt-get);" \
      "install Debian's prometheus package" >&2
    return 0
  fi
  echo "services: installing prometheus (for promtool)"
  (timeout 300 apt-get update -qq && DEBIAN_FRONTEND=noninteractive timeout 600 \
    apt-get install -y -qq --no-install-recommends prometheus) >/dev/null 2>&1 \
    || echo "services: apt-get could not install prometheus (offline? locked?)" >&2
  command -v promtool >/dev/null 2>&1 || echo "services: promtool missing" >&2
}

case "${1:-start}" in
  start)
    rc=0
    start_postgres || rc=1
    start_redis || rc=1
    start_rabbitmq || rc=1
    ensure_faketime
    ensure_promtool
    exit $rc ;;
  status)
    for pair in PostgreSQL:5432 Redis:6379 RabbitMQ:5672; do
      if up "${pair#*:}"; then echo "${pair%:*}: up"; else echo "${pair%:*}: down"; fi
    done ;;
  *) echo "usage: $0 [start|status]" >&2; exit 2 ;;
esac
