"""The PgQueuer peer of :mod:`bench.run` (``pgqueuer``): PgQueuer 1.6 running the shared body.

Schema: ``Queries.install()`` (what ``pgq install`` runs) into the run's scratch database,
then ``Queries.optimize_autovacuum()`` (``pgq autovac``), the first item of the checklist
in PgQueuer's *Performance Tuning* guide. Durability stays the default ``durable`` (logged
tables), as every other system's state is.

Producer (:func:`enqueue`): ``SyncQueries`` over ``SyncPsycopgDriver`` (an autocommit
psycopg 3 connection), which the *Drivers* reference names for enqueueing from
synchronous code; one batch ``enqueue`` call per :data:`CHUNK` tasks, all in one
transaction (PgQueuer's *Enqueue inside a transaction*) whose ``NOW()`` is read first:
PgQueuer stores ``NOW() + execute_after``, so each job's ``execute_after`` is its due time
less that ``NOW()``, and the job is due exactly when the producer set (a delay taken from
the client's clock instead came out 10–22 ms late per 1,000-job call). The payload is
``b"<i> <due_ms>"``.

Worker (``python -m bench.pgqueuer_worker DSN``): one ``PgQueuer`` over a dedicated
asyncpg connection (*Performance Tuning*: "Always use a direct asyncpg connection (not a
pool) for the QueueManager"), run by ``pgqueuer.run`` (what ``pgq run`` does, SIGINT and
SIGTERM stopping it gracefully) on uvloop, as the ``pgq`` CLI runs it. ``batch_size``
BATCH (default 8) and ``max_concurrent_tasks`` CONCURRENCY (default 16): the guide raises
the batch for short jobs, and ``max_concurrent_tasks`` must be at least twice
``batch_size``, so 8 is the largest batch that keeps 16 jobs in flight (a smaller
CONCURRENCY gets half of it). PgQueuer 1.6 refuses a sync entrypoint, its error saying to
wrap blocking code with ``asyncio.to_thread()``; so the ``async`` entrypoint hands
:func:`bench.ledger.record` to the loop's default executor, a pool of CONCURRENCY threads. Other settings keep PgQueuer's defaults
(LISTEN/NOTIFY wake-ups; a deferred job's ``execute_after`` shortens the dequeue wait).

    python -m bench.pgqueuer_worker DSN [--concurrency 16] [--batch 8]
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from datetime import timedelta

import asyncpg
import psycopg
import uvloop
from pgqueuer import PgQueuer, Queries
from pgqueuer import run as run_pgqueuer
from pgqueuer.db import AsyncpgDriver, SyncPsycopgDriver
from pgqueuer.models import Job
from pgqueuer.queries import SyncQueries

from . import ledger

ENTRYPOINT = "bench_ledger"
#: tasks per ``enqueue`` call
CHUNK = 5000
#: ``batch_size`` by default: ``max_concurrent_tasks`` (16) must be at least twice it
BATCH = 8
#: the transaction's ``NOW()`` (what PgQueuer adds ``execute_after`` to), epoch ms
NOW_MS = "SELECT (extract(epoch FROM now()) * 1000)::float8"


async def _install(dsn: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        queries = Queries(AsyncpgDriver(conn))
        await queries.install()
        await queries.optimize_autovacuum()
    finally:
        await conn.close()


def install(dsn: str) -> None:
    """Install PgQueuer's schema into the database ``dsn`` and tune its autovacuum."""
    asyncio.run(_install(dsn))


def enqueue(dsn: str, tasks: Sequence[tuple[int, int]]) -> None:
    """Enqueue ``(i, due_ms)`` tasks, each to run at ``due_ms`` (epoch ms), in one
    transaction: its ``NOW()``, the origin of every ``execute_after``, is read first."""
    with psycopg.connect(dsn, autocommit=True) as conn, conn.transaction():
        now_ms = conn.execute(NOW_MS).fetchone()[0]  # type: ignore[index]
        queries = SyncQueries(SyncPsycopgDriver(conn))
        for start in range(0, len(tasks), CHUNK):
            chunk = tasks[start:start + CHUNK]
            payloads: list[bytes | None] = [f"{i} {due}".encode() for i, due in chunk]
            delays: list[timedelta | None] = [timedelta(milliseconds=due - now_ms)
                                              for _, due in chunk]
            queries.enqueue([ENTRYPOINT] * len(chunk), payloads, [0] * len(chunk), delays)


async def run_body(job: Job) -> None:
    """The entrypoint: :func:`bench.ledger.record` on the loop's default executor."""
    i, due = (job.payload or b"").split()
    await asyncio.to_thread(ledger.record, int(i), int(due))


def factory(dsn: str, threads: int) -> Callable[[], AbstractAsyncContextManager[PgQueuer]]:
    """A ``pgqueuer.run`` factory: a PgQueuer on its own asyncpg connection."""

    @asynccontextmanager
    async def make() -> AsyncIterator[PgQueuer]:
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(threads, thread_name_prefix="pgq"))
        conn = await asyncpg.connect(dsn)
        try:
            pgq = PgQueuer.from_asyncpg_connection(conn)
            pgq.entrypoint(ENTRYPOINT)(run_body)
            yield pgq
        finally:
            await conn.close()

    return make


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dsn")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--batch", type=int, default=None,
                        help="batch_size (default 8, at most half of --concurrency)")
    args = parser.parse_args()
    batch = args.batch or max(1, min(BATCH, args.concurrency // 2))
    uvloop.run(run_pgqueuer(factory(args.dsn, args.concurrency), batch_size=batch,
                            max_concurrent_tasks=args.concurrency))


if __name__ == "__main__":
    main()
