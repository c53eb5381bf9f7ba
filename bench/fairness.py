"""Fair sharing across unequal workers: one worker with 4 default slots, one with 32.

The first design article weights executor nodes by free threads / (backlog + 1). ax pulls
instead: each worker's prefetch on a queue is its pool's free room, so a worker takes work
in proportion to the slots it has free. This measures whether that holds: one
``ax-scheduler``, two ``ax-worker`` processes on the same queue (``-c default=4`` and
``-c default=32``), N tasks of ``--task-ms`` each. The share of each worker is counted from
the store (``owner_node`` of the SUCCESS rows), with both scenarios:

* ``burst`` — N tasks due at the same instant;
* ``steady`` — N tasks spread evenly over ``--spread`` seconds.

    .venv/bin/python -m bench.fairness [--n 4000 --task-ms 20 --spread 20]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import text

from ax_kombu.api import Client
from ax_kombu.config import Settings, from_env

from .common import machine, scratch_database
from .e2e import _env, spawned, wait_done

SLOTS = {"w4": 4, "w32": 32}


@contextmanager
def cluster(settings: Settings, logs: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    """A scheduler and the two unequal workers, warm-stopped on exit."""
    logs.mkdir(parents=True, exist_ok=True)
    specs = [("scheduler", "bench-scheduler", ["-l", "WARNING"])] + [
        ("worker", name, ["-Q", "default", "-A", "bench.e2e", "-l", "WARNING",
                          "-c", f"high=1,default={slots},slow=1"])
        for name, slots in SLOTS.items()]
    with spawned(specs, _env(settings), logs) as procs:
        yield procs


def run(settings: Settings, args: argparse.Namespace, scenario: str) -> dict[str, Any]:
    client = Client(settings)
    with cluster(settings, Path(args.logs) / scenario):
        deadline = time.monotonic() + 60
        while _scalar(client, "SELECT count(*) FROM ax_node WHERE stopped_at IS NULL") < 3:
            if time.monotonic() > deadline:
                raise SystemExit("the daemons did not start; see their logs")
            time.sleep(0.1)
        start = client.store.now_ms() + 5000
        spread = args.spread * 1000 if scenario == "steady" else 0
        items = [{"task_type": "bench.gated", "payload": {"i": i, "ms": args.task_ms},
                  "run_at": datetime.fromtimestamp((start + spread * i // args.n) / 1000, UTC)}
                 for i in range(args.n)]
        client.enqueue_many(items)
        wait_done(client, args.n, 5 + args.spread + 300)
    with client.store.engine.connect() as conn:
        rows = conn.execute(text("SELECT owner_node, count(*) FROM ax_task "
                                 "WHERE status = 'SUCCESS' GROUP BY owner_node")).all()
    client.close()
    done: dict[str, int] = {}
    for node, n in rows:  # a worker's processes are nodes NAME.1, NAME.2 … (--processes auto)
        name = next((w for w in SLOTS if node == w or node.startswith(f"{w}.")), node)
        done[name] = done.get(name, 0) + n
    total = sum(done.values())
    return {f"{node}_share": round(done.get(node, 0) / max(1, total), 3) for node in SLOTS} | {
        "expected_w32_share": round(SLOTS["w32"] / sum(SLOTS.values()), 3), "success": total}


def _scalar(client: Client, sql: str) -> Any:
    with client.store.engine.connect() as conn:
        return conn.execute(text(sql)).scalar()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=4000)
    parser.add_argument("--task-ms", type=int, default=20)
    parser.add_argument("--spread", type=float, default=20.0, help="steady: seconds")
    parser.add_argument("--broker", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--logs", default=f"/tmp/ax-bench-fairness-{os.getpid()}")
    args = parser.parse_args()
    for scenario in ("burst", "steady"):
        with scratch_database(f"ax_bench_fair_{scenario}") as url:
            settings = from_env({}, database_url=url, broker_url=args.broker,
                                broker_key_prefix=f"axfair{os.getpid()}{scenario}:")
            result = run(settings, args, scenario)
        print(f"fairness {scenario} (1 scheduler, workers -c default=4 and default=32, "
              f"{args.n} tasks of {args.task_ms} ms) on {machine()}: "
              + ", ".join(f"{k}={v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
