"""The worker alone: N no-op tasks already claimed and published, one ``ax-worker`` drains them.

Isolates the worker (and the database writes it makes) from the scheduler:
the tasks are claimed (DISPATCHING, attempt 1) and their messages published
to Redis before the worker starts, exactly as a scheduler would have done.
Figures come from the database clock: tasks/s from the first RUNNING move to
the last SUCCESS, and the worker's CPU time over the run.

    .venv/bin/python -m bench.worker [--n 60000] [-c high=8,default=128,slow=8]
"""

from __future__ import annotations

import argparse
import os
import subprocess
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy import text

from ax_kombu.api import Client
from ax_kombu.broker.publisher import Publisher
from ax_kombu.config import from_env
from ax_kombu.scheduler.dispatcher import to_message
from ax_kombu.store import claims

from .common import machine, scratch_database
from .e2e import _cleanup_redis, _command, _env, rss_mb, scalar, wait_done

NODE = "bench-claimer"


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def postgres_cpu_s() -> float:
    """CPU seconds of every local PostgreSQL process so far (this machine's server)."""
    total = 0.0
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/comm") as comm:
                if comm.read().strip() != "postgres":
                    continue
            total += cpu_s(int(pid))
        except (OSError, ValueError):
            continue
    return total


def prepare(client: Client, n: int) -> None:
    """Enqueue n due tasks, claim them all as a scheduler would, publish their messages."""
    run_at = datetime.fromtimestamp((client.store.now_ms() - 1000) / 1000, UTC)
    for base in range(0, n, 20_000):
        client.enqueue_many([{"task_type": "bench.burst", "payload": {"i": i}, "run_at": run_at}
                             for i in range(base, min(n, base + 20_000))])
    with client.store.engine.begin() as conn:
        ids = [r[0] for r in conn.execute(text("SELECT task_id FROM ax_task ORDER BY task_id"))]
    publisher = Publisher(client.settings)
    try:
        for base in range(0, n, 1000):
            with client.store.engine.begin() as conn:
                now = client.store.now_ms()
                rows = claims.claim(conn, ids[base:base + 1000], NODE, now)
            failed = publisher.publish([to_message(r, NODE, now) for r in rows])
            if failed:
                raise SystemExit(f"{len(failed)} messages could not be published")
    finally:
        publisher.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=60_000)
    parser.add_argument("--broker", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--concurrency", "-c", default="high=8,default=128,slow=8")
    parser.add_argument("--set", action="append", default=[], metavar="SETTING=VALUE")
    parser.add_argument("--timeout", type=float, default=120.0, help="give up after this long")
    parser.add_argument("--logs", default=f"/tmp/ax-bench-worker-{os.getpid()}")
    args = parser.parse_args()
    with scratch_database("ax_bench_worker") as url:
        settings = from_env({}, database_url=url, broker_url=args.broker,
                            broker_key_prefix=f"axbench{os.getpid()}:")
        client = Client(settings)
        try:
            prepare(client, args.n)
            Path(args.logs).mkdir(parents=True, exist_ok=True)
            pg_before = postgres_cpu_s()
            with open(Path(args.logs) / "worker.log", "wb") as out:
                proc = subprocess.Popen(
                    [*_command("worker"), "-n", "bench-worker", "-Q", "high,default,slow",
                     "-A", "bench.e2e", "-l", "WARNING", "-c", args.concurrency],
                    env=_env(settings, args.set), stdout=out, stderr=subprocess.STDOUT)
            try:
                done = wait_done(client, args.n, args.timeout)
                cpu, rss = cpu_s(proc.pid), rss_mb(proc.pid)
                pg_cpu = postgres_cpu_s() - pg_before
            finally:
                proc.terminate()
                proc.wait(60)
            first, last = (scalar(client, f"SELECT {f} FROM ax_task") for f in
                           ("MIN(started_at)", "MAX(finished_at)"))
            success = scalar(client, "SELECT COUNT(*) FROM ax_task WHERE status = 'SUCCESS'")
            if done < args.n:  # what is left, e.g. READY: handed back (no scheduler here)
                with client.store.engine.connect() as conn:
                    print("not final:", list(conn.execute(text(
                        "SELECT status, attempt, COUNT(*) FROM ax_task "
                        "WHERE status NOT IN ('SUCCESS', 'FAILED') GROUP BY 1, 2"))))
        finally:
            client.close()
            _cleanup_redis(settings)
    span_s = max(1e-3, (last - first) / 1000)
    print(f"worker alone (-c {args.concurrency}{''.join(' ' + s for s in args.set)}) on "
          f"{machine()}: tasks={args.n}, final={done}, success={success}, "
          f"first_start_to_last_success_ms={last - first}, tasks_per_s={round(args.n / span_s)}, "
          f"worker_cpu_s={cpu:.1f} (includes start-up), postgres_cpu_s={pg_cpu:.1f}, "
          f"worker_rss_mb={rss}")


if __name__ == "__main__":
    main()
