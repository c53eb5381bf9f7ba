"""``enqueue_many`` on the embedded default (SQLite) at two schema revisions, on one database
file: Alembic takes it from one to the other before each measure, the order alternating from
round to round. Made for migration 0018 (``ax_task.armed`` no longer stamped: one write less
per task on SQLite); any two revisions with the same task columns will do.

    .venv/bin/python -m bench.revision_ab [--old 0017] [--new 0018] [--rounds 6]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from alembic import command

from ax_kombu.api import Client
from ax_kombu.config import from_env
from ax_kombu.store.engine import alembic_config


def to(client: Client, revision: str) -> None:
    """Upgrade or downgrade ``client``'s database to ``revision``."""
    cfg = alembic_config()
    with client.store.engine.begin() as conn:
        cfg.attributes["connection"] = conn
        current = conn.exec_driver_sql("SELECT version_num FROM alembic_version").scalar_one()
        if current != revision:
            (command.upgrade if revision > current else command.downgrade)(cfg, revision)


def run(args: argparse.Namespace) -> dict[str, list[float]]:
    """``{revision: [tasks/s per round]}``."""
    got: dict[str, list[float]] = {args.old: [], args.new: []}
    with tempfile.TemporaryDirectory() as scratch:
        client = Client(from_env({}, database_url=f"sqlite:///{Path(scratch) / 'ab.db'}"))
        try:
            for r in range(args.rounds):
                for revision in (args.old, args.new)[::1 if r % 2 == 0 else -1]:
                    to(client, revision)
                    items = [{"task_type": "bench.ab", "payload": {"r": r, "at": revision, "i": i},
                              "delay": 3600 + i} for i in range(args.enqueue)]
                    started = time.perf_counter()
                    for a in range(0, args.enqueue, 1000):
                        client.enqueue_many(items[a:a + 1000])
                    got[revision].append(args.enqueue / (time.perf_counter() - started))
        finally:
            client.close()
    return got


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", default="0017")
    parser.add_argument("--new", default="0018")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--enqueue", type=int, default=5000, help="tasks per measure")
    args = parser.parse_args(argv)
    for revision, rates in run(args).items():
        print(f"{revision}: enqueue_many {statistics.median(rates):,.0f} tasks/s (median); "
              f"rounds {', '.join(f'{x:,.0f}' for x in rates)}")


if __name__ == "__main__":
    main()
