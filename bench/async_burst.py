"""10,000 tasks due at one instant whose body waits 100 ms of I/O: ``async def`` processors on
the worker's event loop against the same body as a sync processor on thread lanes (issue 39).

    python -m bench async-burst [--n 10000] [--modes async,sync] [--repeat 1]
                                [--async-c default=2000] [--sync-c ""] [--lead 10]

Each run starts one ``ax-scheduler`` and one ``ax-worker --processes 1 -A bench.async_burst``
fresh on a scratch PostgreSQL database and Redis, enqueues N tasks due LEAD s later, and
waits until every body has ended (after 100 warm-up tasks, as ``bench run`` does). The body (``bench.async_burst`` here: ``await
asyncio.sleep(0.1)``; ``bench.sync_burst``: ``time.sleep(0.1)``) takes the wall clock at
its start and end; a thread of the worker pushes them to a Redis ledger in batches, so
the body itself makes no round trip. Reported: start − due p50/p99/max, drain (last end −
due), and the tasks recorded SUCCESS. The modes alternate in one session (``--repeat``).

Target (issue 39, Done when): async, one worker process, all started with p99 ≤ 1.5 s
and drained within 3 s. Recorded with ``--set claim_lead_ms=1000`` (and without) in
docs/benchmarks.md, "Issue 39: `async def` processors, a 10,000-task burst".
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import os
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import redis
from sqlalchemy import text

import ax_kombu as ax
from ax_kombu.api import Client
from ax_kombu.config import from_env

from . import ledger
from .common import cpu_s, drop_redis_keys, machine, pct, scratch_database
from .e2e import _env, scalar, spawned, wait_ready

ASYNC_TYPE = "bench.async_burst"
SYNC_TYPE = "bench.sync_burst"
#: the body's I/O wait
BODY_S = 0.1
REDIS_URL = os.environ.get("AX_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
#: tasks run before each measured burst
WARM_UP = 100
#: how often the worker's ledger thread pushes what the bodies recorded
FLUSH_S = 0.05


# -- the bodies (in the worker process) ------------------------------------------------------

class _Ledger:
    """Start and end of each body, kept in memory and pushed to Redis by one thread."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None

    def add(self, i: int, due: int, start_ns: int) -> None:
        line = f"{i} {due} {start_ns / 1e6:.3f} {time.time_ns() / 1e6:.3f}"
        with self.lock:
            self.lines.append(line)
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="bench-ledger",
                                               daemon=True)
                self.thread.start()

    def _run(self) -> None:
        client = redis.Redis.from_url(os.environ[ledger.URL_VAR])
        key = os.environ[ledger.KEY_VAR]
        atexit.register(self.flush, client, key)
        while True:
            time.sleep(FLUSH_S)
            self.flush(client, key)

    def flush(self, client: redis.Redis, key: str) -> None:
        with self.lock:
            lines, self.lines = self.lines, []
        if lines:
            client.rpush(key, *lines)


_ledger = _Ledger()


@ax.processor(ASYNC_TYPE)
async def async_body(payload: Any, ctx: Any) -> None:
    start_ns = time.time_ns()
    await asyncio.sleep(BODY_S)
    _ledger.add(payload["i"], payload["due"], start_ns)


@ax.processor(SYNC_TYPE)
def sync_body(payload: Any, ctx: Any) -> None:
    start_ns = time.time_ns()
    time.sleep(BODY_S)
    _ledger.add(payload["i"], payload["due"], start_ns)


# -- the harness -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Entry:
    i: int
    due_ms: int
    start_ms: float
    end_ms: float


def _read(client: redis.Redis, key: str) -> list[Entry]:
    out = []
    for raw in client.lrange(key, 0, -1):
        i, due, start, end = raw.decode().split()
        out.append(Entry(int(i), int(due), float(start), float(end)))
    return out


def run_once(mode: str, args: argparse.Namespace, tag: str) -> dict[str, Any]:
    """One measured run of ``mode`` (async or sync) on fresh daemons."""
    ledger_key = f"axbench:asyncburst:{tag}"
    rds = redis.Redis.from_url(REDIS_URL)
    rds.delete(ledger_key)
    concurrency = args.async_c if mode == "async" else args.sync_c
    with scratch_database(f"ax_bench_{tag}") as url:
        settings = from_env({}, database_url=url, broker_url=REDIS_URL,
                            broker_key_prefix=f"{tag}:")
        env = {**_env(settings, args.set), ledger.URL_VAR: REDIS_URL, ledger.KEY_VAR: ledger_key}
        worker = ["-Q", "high,default,slow", "-A", "bench.async_burst", "-l", "WARNING",
                  "--processes", "1", *(["-c", concurrency] if concurrency else [])]
        specs = [("scheduler", f"{tag}-scheduler", ["-l", "WARNING"]),
                 ("worker", f"{tag}-worker", worker)]
        client = Client(settings)
        logs = Path(args.logs)
        logs.mkdir(parents=True, exist_ok=True)
        try:
            with spawned(specs, env, logs) as procs:
                wait_ready(client, procs)
                task_type = ASYNC_TYPE if mode == "async" else SYNC_TYPE
                _warm_up(client, rds, ledger_key, task_type)
                due = _enqueue(client, args.n, args.lead, task_type)
                deadline = time.monotonic() + args.lead + args.timeout
                cpu_before = cpu_s(procs[1].pid)
                while rds.llen(ledger_key) < args.n and time.monotonic() < deadline:
                    time.sleep(0.2)
                cpu = {"worker_cpu_s": round(cpu_s(procs[1].pid) - cpu_before, 2)}
                time.sleep(0.5)  # the last results are written in batches
                success = int(scalar(client, "SELECT COUNT(*) FROM ax_task "
                                             "WHERE status = 'SUCCESS'"))
                dispatched = _dispatched(client, due)
        finally:
            client.close()
            drop_redis_keys(REDIS_URL, f"{tag}:")
    entries = _read(rds, ledger_key)
    rds.delete(ledger_key)
    return {**_figures(mode, concurrency, entries, due, success), **dispatched, **cpu}


def _dispatched(client: Client, due: int) -> dict[str, Any]:
    """From the rows: publish − due (the scheduler's share of the lateness) and taken − due
    (``started_at``: when a pool thread took the run, before its body started)."""
    with client.store.engine.connect() as conn:
        rows = list(conn.execute(text(
            "SELECT dispatched_at, started_at FROM ax_task WHERE trigger_time = :due"),
            {"due": due}))
    late = [r.dispatched_at - due for r in rows if r.dispatched_at is not None]
    taken = [r.started_at - due for r in rows if r.started_at is not None]
    return {"dispatch_p50_ms": round(pct(late, 50)) if late else None,
            "dispatch_p99_ms": round(pct(late, 99)) if late else None,
            "taken_p50_ms": round(pct(taken, 50)) if taken else None,
            "taken_p99_ms": round(pct(taken, 99)) if taken else None}


def _warm_up(client: Client, rds: redis.Redis, key: str, task_type: str) -> None:
    """:data:`WARM_UP` tasks due now, run before the burst (as bench.run does: the worker
    has measured its run time, so it stages what it can finish), then off the ledger."""
    _enqueue(client, WARM_UP, 0.0, task_type, check=False)
    deadline = time.monotonic() + 60
    while rds.llen(key) < WARM_UP and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)  # their results and acks
    rds.delete(key)


def _enqueue(client: Client, n: int, lead_s: float, task_type: str, check: bool = True) -> int:
    """``n`` tasks due ``lead_s`` from now (database clock); returns the due time (ms)."""
    due = client.store.now_ms() + int(lead_s * 1000)
    run_at = datetime.fromtimestamp(due / 1000, UTC)
    for base in range(0, n, 20_000):
        client.enqueue_many([{"task_type": task_type, "run_at": run_at,
                              "payload": {"i": i, "due": due}}
                             for i in range(base, min(n, base + 20_000))])
    if check and client.store.now_ms() >= due:
        raise SystemExit(f"enqueueing took longer than --lead {lead_s}s; raise it")
    return due


def _figures(mode: str, concurrency: str, entries: list[Entry], due: int,
             success: int) -> dict[str, Any]:
    starts = [e.start_ms - due for e in entries]
    return {"mode": mode, "c": concurrency or "default", "ran": len(entries),
            "success": success,
            "start_p50_ms": round(pct(starts, 50)) if starts else None,
            "start_p99_ms": round(pct(starts, 99)) if starts else None,
            "start_max_ms": round(max(starts)) if starts else None,
            "drain_ms": round(max(e.end_ms for e in entries) - due) if entries else None}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench async-burst", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=10_000)
    parser.add_argument("--modes", default="async,sync")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--async-c", default="default=2000",
                        help="worker -c for the async run (slots of its default lane)")
    parser.add_argument("--sync-c", default="",
                        help="worker -c for the sync run (empty: ax's default thread lanes)")
    parser.add_argument("--lead", type=float, default=10.0, help="seconds until due")
    parser.add_argument("--timeout", type=float, default=180.0,
                        help="give up this long after the due time")
    parser.add_argument("--set", action="append", default=[], metavar="SETTING=VALUE",
                        help="an ax setting for both daemons, e.g. lane_threads_max=64")
    parser.add_argument("--logs", default=f"/tmp/ax-bench-async-{os.getpid()}")
    args = parser.parse_args(argv)
    print(f"async burst on {machine()}: n={args.n}, body {BODY_S * 1000:.0f} ms, "
          f"1 worker process, settings {args.set or 'default'}")
    for round_ in range(args.repeat):
        for mode in args.modes.split(","):
            tag = f"ab{os.getpid()}{mode}{round_}"
            result = run_once(mode, args, tag)
            print(", ".join(f"{k}={v}" for k, v in result.items()), flush=True)


if __name__ == "__main__":
    main()
