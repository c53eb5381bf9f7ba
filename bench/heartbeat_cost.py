"""What the heartbeats cost the database: writes and transactions per second per node, idle
(issue 40: the default interval went from 5 s to 1 s so a dead node's work moves in seconds).

    python -m bench heartbeat-cost [--intervals 1,5] [--seconds 30] [--workers 2]

For each interval, one ``ax-scheduler`` and ``--workers`` ``ax-worker --processes 1`` start
fresh on a scratch PostgreSQL database and Redis, with nothing to run; after a warm-up of a
few beats, PostgreSQL's own counters are read over ``--seconds``: ``ax_node`` rows updated
(``pg_stat_user_tables.n_tup_upd``: the beats), and the database's committed transactions
(``pg_stat_database.xact_commit``: beats, the scheduler's preload rounds and housekeeping,
the workers' own timers). Reported per second, and per node per second.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from sqlalchemy import text

from ax_kombu.api import Client
from ax_kombu.config import from_env

from .common import drop_redis_keys, machine, scratch_database
from .e2e import _env, spawned

REDIS_URL = "redis://127.0.0.1:6379/0"
#: beats a node has written before the counters are read
WARM_BEATS = 3


def _counters(client: Client, database: str) -> tuple[int, int]:
    """(``ax_node`` rows updated, transactions committed) so far; the statistics snapshot
    is cleared first so each read is fresh."""
    with client.store.engine.connect() as conn:
        conn.execute(text("SELECT pg_stat_clear_snapshot()"))
        updated = conn.execute(text(
            "SELECT n_tup_upd FROM pg_stat_user_tables WHERE relname = 'ax_node'")).scalar()
        commits = conn.execute(text(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = :d"), {"d": database}).scalar()
    return int(updated or 0), int(commits or 0)


def measure(interval_s: float, args: argparse.Namespace) -> dict[str, Any]:
    tag = f"hb{str(interval_s).replace('.', '_')}"
    name = f"ax_bench_{tag}"
    with scratch_database(name) as url:
        settings = from_env({}, database_url=url, broker_url=REDIS_URL,
                            broker_key_prefix=f"{tag}:")
        env = _env(settings, [f"heartbeat_interval_s={interval_s}"])
        specs = [("scheduler", f"{tag}-s0", ["-l", "WARNING"])]
        specs += [("worker", f"{tag}-w{i}", ["-Q", "high,default,slow", "-l", "WARNING",
                                             "--processes", "1"]) for i in range(args.workers)]
        logs = Path(args.logs)
        logs.mkdir(parents=True, exist_ok=True)
        client = Client(settings)
        try:
            with spawned(specs, env, logs) as procs:
                nodes = len(procs)
                deadline = time.monotonic() + 60
                while _live(client) < nodes:
                    if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                        raise SystemExit("the daemons did not start; see their logs")
                    time.sleep(0.1)
                time.sleep(WARM_BEATS * interval_s)  # a few beats before the counters
                updated0, commits0 = _counters(client, name)
                t0 = time.monotonic()
                time.sleep(args.seconds)
                updated1, commits1 = _counters(client, name)
                elapsed = time.monotonic() - t0
        finally:
            client.close()
            drop_redis_keys(REDIS_URL, f"{tag}:")
    beats = (updated1 - updated0) / elapsed
    commits = (commits1 - commits0) / elapsed
    return {"interval_s": interval_s, "nodes": nodes, "node_updates_per_s": round(beats, 2),
            "node_updates_per_node_s": round(beats / nodes, 2),
            "commits_per_s": round(commits, 1), "commits_per_node_s": round(commits / nodes, 1)}


def _live(client: Client) -> int:
    with client.store.engine.connect() as conn:
        return int(conn.execute(text(
            "SELECT COUNT(*) FROM ax_node WHERE stopped_at IS NULL")).scalar() or 0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench heartbeat-cost",
                                     description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--intervals", default="1,5",
                        help="heartbeat intervals to measure, in seconds (comma-separated)")
    parser.add_argument("--seconds", type=float, default=30.0, help="how long to count")
    parser.add_argument("--workers", type=int, default=2, help="worker processes")
    parser.add_argument("--logs", default="/tmp/ax-bench-heartbeat", help="daemon logs")
    args = parser.parse_args(argv)
    print(f"heartbeat cost on {machine()}: 1 scheduler + {args.workers} workers, idle, "
          f"{args.seconds:g} s counted")
    for interval in (float(x) for x in args.intervals.split(",")):
        result = measure(interval, args)
        print(", ".join(f"{k}={v}" for k, v in result.items()), flush=True)


if __name__ == "__main__":
    main()
