"""Memory of the daemons (issue 15): RSS of one ``ax-scheduler`` and one ``ax-worker``
as the store fills with future tasks, then through a same-instant burst.

PostgreSQL (a scratch database) + Redis, the daemons as :mod:`bench.e2e` starts them.

1. The store is filled in steps (default to 10,000, then 100,000, then 1,000,000 future
   tasks), each step one bulk ``INSERT … SELECT generate_series`` made by the database
   (DELAYED tasks due 1–2 hours ahead, spread evenly) and an ``ANALYZE``. After each step
   the daemons run for ``--settle`` seconds (default 12) before VmRSS and VmHWM are read
   from ``/proc``: with the recovery scan every ``--recovery-interval`` s (default 5 here,
   30 by default in ax) that is two recovery scans and about twelve preload rounds (one a
   second) over the grown table.
2. With the largest backlog still there, BURST tasks (default 100,000, no-op,
   ``enqueue_many`` in batches of 20,000) fall due at one instant ``--lead`` s ahead.
   VmRSS of both daemons is sampled every 0.1 s from the first enqueue until every burst
   task is final; the peaks are reported with VmHWM (the kernel's own peak since start)
   and the RSS ``--settle`` s after the burst.

    .venv/bin/python -m bench.memory [--levels 10000,100000,1000000] [--burst 100000]
                                     [-c high=8,default=16,slow=8]
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import text

from ax_kombu.api import Client
from ax_kombu.config import from_env
from ax_kombu.store.engine import make_engine

from .common import machine, proc_mb, scratch_database, wait_quiet
from .e2e import _cleanup_redis, daemons, enqueue_burst, scalar, wait_done, wait_ready

HOUR = 3_600_000

# future tasks, ids ``:first + g`` (far below any snowflake id ax hands out), due 1–2 h ahead
_FILL = """
INSERT INTO ax_task (task_id, task_type, trigger_time, status, priority, retry_count,
    max_retry, timeout_ms, processor_name, payload, fingerprint, trace_id, attempt, created_at)
SELECT :first + g, 'bench.future',
       CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT) + :hour
           + (g * CAST(:hour AS BIGINT)) / :n,
       'DELAYED', 'default', 0, 3, 60000, 'bench.future', '{"i": ' || (:first + g) || '}',
       md5((:first + g)::text), md5((-(:first + g))::text), 0,
       CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT)
  FROM generate_series(0, :n - 1) AS g
"""


def fill(url: str, first: int, n: int) -> float:
    """Add ``n`` future tasks with ids from ``first``; returns seconds taken."""
    started = time.monotonic()
    engine = make_engine(url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(text(_FILL), {"first": first, "n": n, "hour": HOUR})
        conn.execute(text("ANALYZE ax_task"))
    engine.dispose()
    return time.monotonic() - started


class Sampler(threading.Thread):
    """VmRSS of some processes every ``every_s``; keeps each one's peak."""

    def __init__(self, pids: dict[str, int], every_s: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.pids, self.every_s = pids, every_s
        self.peak = dict.fromkeys(pids, 0)
        self.samples = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            for name, pid in self.pids.items():
                self.peak[name] = max(self.peak[name], proc_mb(pid, "VmRSS"))
            self.samples += 1
            self.done.wait(self.every_s)

    def stop(self) -> dict[str, int]:
        self.done.set()
        self.join(5)
        return self.peak


def snapshot(label: str, rows: int, pids: dict[str, int], note: str = "",
             rss: dict[str, int] | None = None) -> dict[str, Any]:
    """VmRSS (or the given sampled peaks ``rss``) and VmHWM of each process now."""
    out: dict[str, Any] = {"when": label, "rows": rows}
    for name, pid in pids.items():
        out[f"{name}_rss_mb"] = rss[name] if rss else proc_mb(pid, "VmRSS")
        out[f"{name}_hwm_mb"] = proc_mb(pid, "VmHWM")
    out["load1"] = round(os.getloadavg()[0], 2)
    out["utc"] = datetime.now(UTC).strftime("%H:%M:%S")
    out["note"] = note
    print("  " + ", ".join(f"{k}={v}" for k, v in out.items()), flush=True)
    return out


def run(url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    settings = from_env({}, database_url=url, broker_url=args.broker,
                        broker_key_prefix=f"axbench{os.getpid()}:")
    client = Client(settings)
    found: list[dict[str, Any]] = []
    daemon_args = argparse.Namespace(logs=args.logs, concurrency=args.concurrency,
                                     prefetch_multiplier=None,
                                     set=[f"recovery_interval_s={args.recovery_interval}"])
    try:
        with daemons(settings, daemon_args) as procs:
            wait_ready(client, procs)
            pids = {"scheduler": procs[0].pid, "worker": procs[1].pid}
            time.sleep(args.settle)
            found.append(snapshot("idle", 0, pids, f"after {args.settle:g} s"))
            have = 0
            for level in args.levels:
                took = fill(url, have + 1, level - have)
                have = level
                time.sleep(args.settle)
                rows = int(scalar(client, "SELECT COUNT(*) FROM ax_task"))
                found.append(snapshot(f"{level:,} future", rows, pids,
                                      f"filled in {took:.1f} s, then {args.settle:g} s"))
            sampler = Sampler(pids)
            sampler.start()
            started = time.monotonic()
            trigger = enqueue_burst(client, args.burst, args.lead)
            done = wait_done(client, args.burst, args.lead + args.timeout)
            last = int(scalar(client, "SELECT MAX(finished_at) FROM ax_task"))
            peak = sampler.stop()
            # VmRSS: the sampled peak; VmHWM: the kernel's peak since the process started
            found.append(snapshot(f"{args.burst:,} burst: peak", have + args.burst, pids,
                                  f"{done:,} final, "
                                  f"{args.burst / max(1e-3, (last - trigger) / 1000):,.0f} "
                                  f"tasks/s, {sampler.samples} samples over "
                                  f"{time.monotonic() - started:.0f} s", rss=peak))
            time.sleep(args.settle)
            found.append(snapshot("after the burst", have + args.burst, pids,
                                  f"{args.settle:g} s after the last task"))
    finally:
        client.close()
        _cleanup_redis(settings)
    return found


def table(found: list[dict[str, Any]]) -> str:
    lines = [("| store / moment | scheduler VmRSS | scheduler VmHWM | worker VmRSS | "
              "worker VmHWM | load1 | UTC | note |"), "|---|---|---|---|---|---|---|---|"]
    for f in found:
        lines.append(f"| {f['when']} | {f['scheduler_rss_mb']} MB | {f['scheduler_hwm_mb']} MB | "
                     f"{f['worker_rss_mb']} MB | {f['worker_hwm_mb']} MB | {f['load1']} | "
                     f"{f['utc']} | {f['note']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="10000,100000,1000000",
                        help="future tasks in the store at each step (cumulative)")
    parser.add_argument("--burst", type=int, default=100_000)
    parser.add_argument("--lead", type=float, default=20.0, help="burst: seconds until due")
    parser.add_argument("--settle", type=float, default=12.0,
                        help="seconds the daemons run after each step before the reading")
    parser.add_argument("--recovery-interval", type=float, default=5.0,
                        help="the scheduler's recovery_interval_s for this run")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--broker", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--concurrency", "-c", default=None,
                        help="worker -c (default: ax's pools, high=8,default=16,slow=8)")
    parser.add_argument("--logs", default=f"/tmp/ax-bench-memory-{os.getpid()}")
    args = parser.parse_args()
    args.levels = [int(x) for x in args.levels.split(",")]
    wait_quiet()
    with scratch_database(f"ax_bench_memory_{os.getpid()}") as url:
        found = run(url, args)
    print(f"memory (1 scheduler + 1 worker -c {args.concurrency or 'default'}, PostgreSQL + "
          f"Redis, recovery every {args.recovery_interval:g} s) on {machine()}:")
    print(table(found))


if __name__ == "__main__":
    main()
