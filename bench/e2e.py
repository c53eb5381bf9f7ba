"""End to end: one ``ax-scheduler`` process and one ``ax-worker`` process, no-op tasks.

Every figure comes from the database, where each state change is persisted:
``trigger_time``, ``dispatched_at`` (claimed for publishing), ``started_at`` (the
worker's RUNNING move) and ``finished_at`` (SUCCESS recorded), all on the database
clock. PostgreSQL (a scratch database) + Redis by default.

Scenarios:

* ``burst``  — N tasks (default 100,000) due at the same instant: time from the
  trigger instant until the last SUCCESS is recorded, tasks/s end to end, and
  p50/p99 of start − trigger.
* ``steady`` — a producer process enqueues RATE tasks/s (default 2,000) with delays
  spread over 0.05–30 s for DURATION s (default 60): p50/p99/max of start − trigger.
* ``gated`` — ``burst`` through the gated claim: each task has one of KEYS order keys
  (default 1,000) and its type a cluster-wide limit (default 50); ``--keys 0 --limit 0``
  is the same burst without either, for a same-run baseline.

The worker runs with the ordinary flags (``-c``, ``--prefetch-multiplier``) and
defaults otherwise; a task the worker did not start within the ack timeout is
dispatched again, and the ``redispatched`` figure counts those.

    .venv/bin/python -m bench.e2e burst [--n 100000] [--concurrency high=8,default=16,slow=8]
    .venv/bin/python -m bench.e2e steady [--rate 2000 --duration 60]
    .venv/bin/python -m bench.e2e gated [--n 10000 --keys 1000 --limit 50]

This module is also the worker's processor module (``-A bench.e2e``).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import text

import ax_kombu as ax
from ax_kombu.api import Client
from ax_kombu.config import Settings, from_env

from . import ledger
from .common import drop_redis_keys, machine, pct, proc_mb, scratch_database

ROOT = Path(__file__).resolve().parents[1]


@ax.processor("bench.burst")
def noop(payload: Any, ctx: Any) -> None:
    """Does nothing: the figures are ax's own cost."""


@ax.processor("bench.steady")
def steady_body(payload: Any, ctx: Any) -> None:
    """Does nothing, unless a ledger is set (:mod:`bench.ledger`, ``AXBENCH_LEDGER_*`` in
    the worker's environment; :mod:`bench.archive` sets it): then it records its own start
    against the task's trigger time, one ``RPUSH``."""
    if ledger.configured():
        ledger.record(payload["n"], ctx.trigger_time)


@ax.processor("bench.gated")
def gated(payload: Any, ctx: Any) -> None:
    """Sleeps ``payload["ms"]`` (``--task-ms``; 0: returns at once)."""
    if payload.get("ms"):
        time.sleep(payload["ms"] / 1000.0)


# -- the daemons ----------------------------------------------------------------------------------

def _env(settings: Settings, extra: list[str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AX_")}
    for item in extra or []:  # --set worker_receipt_writers=3 → AX_WORKER_RECEIPT_WRITERS=3
        name, _, value = item.partition("=")
        env[f"AX_{name.upper()}"] = value
    env.update({"AX_DATABASE_URL": settings.database_url, "AX_BROKER_URL": settings.broker_url,
                "AX_BROKER_KEY_PREFIX": settings.broker_key_prefix,
                "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)})
    return env


def _command(kind: str) -> list[str]:
    script = Path(sys.executable).parent / f"ax-{kind}"
    return [str(script)] if script.exists() else [
        sys.executable, "-c", f"from ax_kombu.cli.{kind} import main; main()"]


@contextmanager
def daemons(settings: Settings, args: argparse.Namespace) -> Iterator[list[subprocess.Popen[bytes]]]:
    """An ax-scheduler and an ax-worker, warm-stopped on exit; logs in --logs."""
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    worker_args = ["-Q", "high,default,slow", "-A", "bench.e2e", "-l", "WARNING"]
    if args.concurrency:
        worker_args += ["-c", args.concurrency]
    if args.prefetch_multiplier:
        worker_args += ["--prefetch-multiplier", str(args.prefetch_multiplier)]
    specs = [("scheduler", "bench-scheduler", ["-l", "WARNING"]),
             ("worker", "bench-worker", worker_args)]
    with spawned(specs, _env(settings, args.set), logs) as procs:
        yield procs


@contextmanager
def spawned(specs: list[tuple[str, str, list[str]]], env: dict[str, str],
            logs: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``(kind, name, args)`` daemons started with ``env``, logging to ``logs/<name>.log``;
    warm-stopped (SIGTERM, then killed after 60 s) on exit."""
    procs = []
    for kind, name, extra in specs:
        with open(logs / f"{name}.log", "wb") as out:
            procs.append(subprocess.Popen([*_command(kind), "-n", name, *extra], env=env,
                                          stdout=out, stderr=subprocess.STDOUT))
    try:
        yield procs
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def rss_mb(pid: int) -> int:
    """The process's RSS now, in MB."""
    return proc_mb(pid, "VmRSS")


def scalar(client: Client, sql: str, **params: Any) -> Any:
    with client.store.engine.connect() as conn:
        return conn.execute(text(sql), params).scalar()


def wait_ready(client: Client, procs: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + 60
    while scalar(client, "SELECT COUNT(*) FROM ax_node WHERE stopped_at IS NULL") < 2:
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise SystemExit("the daemons did not start; see their logs")
        time.sleep(0.1)


def wait_done(client: Client, total: int, deadline_s: float) -> int:
    """Poll until ``total`` tasks are final (or the deadline); returns how many are."""
    deadline = time.monotonic() + deadline_s
    while True:
        done = int(scalar(client, "SELECT COUNT(*) FROM ax_task "
                                  "WHERE status IN ('SUCCESS', 'FAILED', 'CANCELLED')"))
        if done >= total or time.monotonic() > deadline:
            return done
        time.sleep(1.0)  # each count reads the table: poll gently (figures come from the rows)


def figures(client: Client) -> dict[str, Any]:
    """Lateness figures over every task, from the database."""
    with client.store.engine.connect() as conn:
        rows = list(conn.execute(text(
            "SELECT trigger_time, dispatched_at, started_at, finished_at, attempt, status "
            "FROM ax_task")))
    ok = [r for r in rows if r.status == "SUCCESS"]
    start = [r.started_at - r.trigger_time for r in ok]
    dispatch = [r.dispatched_at - r.trigger_time for r in ok]
    return {"tasks": len(rows), "success": len(ok),
            "redispatched": sum(r.attempt > 1 for r in rows),
            "dispatch_p50_ms": pct(dispatch, 50), "dispatch_p99_ms": pct(dispatch, 99),
            "start_p50_ms": pct(start, 50), "start_p99_ms": pct(start, 99),
            "start_max_ms": max(start), "last_finished": max(r.finished_at for r in ok)}


# -- scenarios ------------------------------------------------------------------------------------

def enqueue_burst(client: Client, n: int, lead_s: float, task_type: str = "bench.burst") -> int:
    """``n`` tasks ``{"i": i}`` all due ``lead_s`` from now (database clock), in bulk; returns
    their trigger time (epoch ms). Fails if enqueueing took longer than the lead."""
    trigger = client.store.now_ms() + int(lead_s * 1000)
    run_at = datetime.fromtimestamp(trigger / 1000, UTC)
    for base in range(0, n, 20_000):
        client.enqueue_many([{"task_type": task_type, "run_at": run_at, "payload": {"i": i}}
                             for i in range(base, min(n, base + 20_000))])
    if client.store.now_ms() >= trigger:
        raise SystemExit(f"enqueueing took longer than --lead {lead_s}s; raise it")
    return trigger


def burst(settings: Settings, args: argparse.Namespace) -> dict[str, Any]:
    client = Client(settings)
    with daemons(settings, args) as procs:
        wait_ready(client, procs)
        trigger = client.store.now_ms() + int(args.lead * 1000)
        run_at = datetime.fromtimestamp(trigger / 1000, UTC)
        if args.scenario == "gated" and args.limit:
            client.set_limit("bench.gated", args.limit)
        gated = args.scenario == "gated"
        keys = args.keys if gated else 0
        for base in range(0, args.n, 20_000):
            client.enqueue_many([{"task_type": "bench.gated" if gated else "bench.burst",
                                  "run_at": run_at,
                                  "payload": {"i": i, "ms": args.task_ms} if gated else {"i": i},
                                  "order_key": f"k{i % keys}" if keys else None}
                                 for i in range(base, min(args.n, base + 20_000))])
        if client.store.now_ms() >= trigger:
            raise SystemExit(f"enqueueing took longer than --lead {args.lead}s; raise it")
        wait_done(client, args.n, args.lead + args.timeout)
        rss = {"scheduler_rss_mb": rss_mb(procs[0].pid), "worker_rss_mb": rss_mb(procs[1].pid)}
    result = figures(client)
    client.close()
    last = result.pop("last_finished") - trigger
    return {"tasks": result.pop("tasks"), "success": result.pop("success"),
            "last_success_after_trigger_ms": last,
            "tasks_per_s": round(args.n / max(1e-3, last / 1000)), **result, **rss}


def steady(settings: Settings, args: argparse.Namespace) -> dict[str, Any]:
    client = Client(settings)
    with daemons(settings, args) as procs:
        wait_ready(client, procs)
        producer = subprocess.Popen([sys.executable, "-m", "bench.produce", str(args.rate),
                                     str(args.duration)], env=_env(settings), cwd=ROOT,
                                    stdout=subprocess.PIPE, text=True)
        out, _ = producer.communicate(timeout=args.duration + 120)
        produced = int(out.split()[0])
        wait_done(client, produced, 30 + args.timeout)
        rss = {"scheduler_rss_mb": rss_mb(procs[0].pid), "worker_rss_mb": rss_mb(procs[1].pid)}
    result = figures(client)
    result.pop("last_finished")
    client.close()
    return {"produced": produced, "rate_per_s": args.rate, **result, **rss}


def _cleanup_redis(settings: Settings) -> None:
    if not settings.broker_url.startswith("redis"):
        return
    drop_redis_keys(settings.broker_url, settings.broker_key_prefix)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenario", choices=["burst", "steady", "gated"])
    parser.add_argument("--keys", type=int, default=1000, help="gated: order keys (0: none)")
    parser.add_argument("--limit", type=int, default=50, help="gated: the type's limit (0: none)")
    parser.add_argument("--task-ms", type=int, default=0, help="gated: each task sleeps this")
    parser.add_argument("--n", type=int, default=100_000, help="burst: tasks due at once")
    parser.add_argument("--lead", type=float, default=15.0, help="burst: seconds until due")
    parser.add_argument("--rate", type=int, default=2000, help="steady: tasks/s enqueued")
    parser.add_argument("--duration", type=float, default=60.0, help="steady: seconds")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="give up this long after the last task is due")
    parser.add_argument("--broker", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--concurrency", "-c", default=None,
                        help="worker -c, e.g. high=8,default=16,slow=8 (default: ax's)")
    parser.add_argument("--prefetch-multiplier", type=int, default=None,
                        help="worker --prefetch-multiplier (default: ax's)")
    parser.add_argument("--set", action="append", default=[], metavar="SETTING=VALUE",
                        help="an ax setting for both daemons, e.g. worker_receipt_writers=3")
    parser.add_argument("--logs", default=f"/tmp/ax-bench-e2e-{os.getpid()}",
                        help="where the daemons' logs go")
    args = parser.parse_args()
    with scratch_database(f"ax_bench_e2e_{args.scenario}") as url:
        settings = from_env({}, database_url=url, broker_url=args.broker,
                            broker_key_prefix=f"axbench{os.getpid()}:")
        try:
            result = (steady if args.scenario == "steady" else burst)(settings, args)
        finally:
            _cleanup_redis(settings)
    flags = f"-c {args.concurrency or 'default'}" + (
        f" --prefetch-multiplier {args.prefetch_multiplier}" if args.prefetch_multiplier else ""
    ) + "".join(f" {item}" for item in args.set) + (
        f" --keys {args.keys} --limit {args.limit} --task-ms {args.task_ms}"
        if args.scenario == "gated" else "")
    print(f"{args.scenario} (ax e2e, 1 scheduler + 1 worker {flags}) on {machine()}: "
          + ", ".join(f"{k}={v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
