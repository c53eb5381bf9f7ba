"""The table-polling baseline of :mod:`bench.run`: what many teams build instead of a scheduler.

A plain PostgreSQL table, ``bench_poll (id, due_ms, status, claimed_ms)``, with a partial
index on ``due_ms`` over the pending rows. One process polls it every INTERVAL ms (default
200) on ``time.monotonic()`` ticks (a late tick is not replayed): in one transaction it
claims up to BATCH due rows (default 1,000)::

    UPDATE bench_poll SET status = 'running', claimed_ms = :now
     WHERE id IN (SELECT id FROM bench_poll WHERE status = 'pending' AND due_ms <= :now
                   ORDER BY due_ms LIMIT :batch FOR UPDATE SKIP LOCKED)
    RETURNING id, due_ms

and hands each row to a thread pool of THREADS (default 16) running the shared body
(:func:`bench.ledger.record`). Rows are not marked done afterwards: the baseline is spared
that write. SIGTERM or SIGINT stops it after the current tick; the pool finishes what it has.

``--tight`` is the poller a team tunes for latency instead (the ``tight-poller`` peer of
:mod:`bench.systems`): THREADS threads (default 16), each on its own connection, each in its
own loop claiming up to BATCH due rows (default 50) with the same statement (claimed and
marked ``running`` in one transaction), running the body for each in turn, then marking them
``done`` in one statement (``UPDATE … WHERE id = ANY(…)``). A thread polls again at once
while its claims return rows, and sleeps IDLE ms (default 50) only after one returned none.
SIGTERM or SIGINT stops each thread after its current batch.

    python -m bench.poller DSN [--interval-ms 200] [--batch 1000] [--threads 16]
    python -m bench.poller DSN --tight [--batch 50] [--threads 16] [--idle-ms 50]
"""

from __future__ import annotations

import argparse
import signal
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from types import FrameType

import psycopg2
import psycopg2.extensions
import psycopg2.extras

from . import ledger

DDL = """
CREATE TABLE IF NOT EXISTS bench_poll (
    id BIGINT PRIMARY KEY,
    due_ms BIGINT NOT NULL,
    status TEXT NOT NULL DEFAULT 'pending',
    claimed_ms BIGINT
);
CREATE INDEX IF NOT EXISTS bench_poll_due ON bench_poll (due_ms) WHERE status = 'pending';
"""

CLAIM = """
UPDATE bench_poll SET status = 'running', claimed_ms = %(now)s
 WHERE id IN (SELECT id FROM bench_poll WHERE status = 'pending' AND due_ms <= %(now)s
               ORDER BY due_ms LIMIT %(batch)s FOR UPDATE SKIP LOCKED)
RETURNING id, due_ms
"""

DONE = "UPDATE bench_poll SET status = 'done' WHERE id = ANY(%(ids)s)"
#: ``--batch`` when not given: per tick (interval mode), per claim (``--tight``)
BATCH = 1000
TIGHT_BATCH = 50


def create_table(dsn: str) -> None:
    """Create ``bench_poll`` and its index in the database ``dsn`` (if missing)."""
    with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
        cur.execute(DDL)
    conn.close()


def insert(dsn: str, rows: Iterable[tuple[int, int]]) -> None:
    """Insert ``(id, due_ms)`` rows as pending, in one transaction."""
    with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
        psycopg2.extras.execute_values(cur, "INSERT INTO bench_poll (id, due_ms) VALUES %s",
                                       list(rows), page_size=5000)
    conn.close()


def claim(conn: psycopg2.extensions.connection, batch: int) -> list[tuple[int, int]]:
    """Claim up to ``batch`` due rows (marked ``running``) in one committed transaction."""
    with conn, conn.cursor() as cur:
        cur.execute(CLAIM, {"now": time.time_ns() // 1_000_000, "batch": batch})
        rows: list[tuple[int, int]] = cur.fetchall()
    return rows


def poll(dsn: str, interval_s: float, batch: int, threads: int, stop: threading.Event) -> None:
    """Claim due rows every ``interval_s`` and run the body in a pool, until ``stop`` is set."""
    conn = psycopg2.connect(dsn)
    pool = ThreadPoolExecutor(threads, thread_name_prefix="poll")
    tick = time.monotonic()
    try:
        while not stop.is_set():
            for task_id, due_ms in claim(conn, batch):
                pool.submit(ledger.record, task_id, due_ms)
            tick += interval_s
            now = time.monotonic()
            tick = max(tick, now)  # after a stall, skip the missed ticks instead of replaying
            stop.wait(tick - now)
    finally:
        pool.shutdown(wait=True)
        conn.close()


def tight_loop(dsn: str, batch: int, idle_s: float, stop: threading.Event) -> None:
    """One ``--tight`` thread: claim, run the body for each row, mark them done in one
    statement; poll again at once while rows come back, sleep ``idle_s`` when none did."""
    conn = psycopg2.connect(dsn)
    try:
        while not stop.is_set():
            rows = claim(conn, batch)
            if not rows:
                stop.wait(idle_s)
                continue
            for task_id, due_ms in rows:
                ledger.record(task_id, due_ms)
            with conn, conn.cursor() as cur:
                cur.execute(DONE, {"ids": [task_id for task_id, _ in rows]})
    finally:
        conn.close()


def tight_poll(dsn: str, batch: int, threads: int, idle_s: float, stop: threading.Event) -> None:
    """Run ``threads`` :func:`tight_loop` threads until ``stop`` is set and each has ended."""
    workers = [threading.Thread(target=tight_loop, args=(dsn, batch, idle_s, stop),
                                name=f"tight-{k}") for k in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dsn")
    parser.add_argument("--tight", action="store_true",
                        help="one claiming loop per thread, re-polling at once (see above)")
    parser.add_argument("--interval-ms", type=float, default=200.0)
    parser.add_argument("--idle-ms", type=float, default=50.0,
                        help="--tight: a thread's sleep after a claim returned nothing")
    parser.add_argument("--batch", type=int, default=None,
                        help=f"rows per claim (default {BATCH:,}; --tight: {TIGHT_BATCH})")
    parser.add_argument("--threads", type=int, default=16)
    args = parser.parse_args()
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if args.tight:
        tight_poll(args.dsn, args.batch or TIGHT_BATCH, args.threads, args.idle_ms / 1000, stop)
    else:
        poll(args.dsn, args.interval_ms / 1000, args.batch or BATCH, args.threads, stop)


if __name__ == "__main__":
    main()
