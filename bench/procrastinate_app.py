"""The Procrastinate peer of :mod:`bench.run` (``procrastinate``): its app, schema and
producer; the worker is :mod:`bench.procrastinate_worker`. Procrastinate 3.10.

The app lives in this module, not in the worker's ``__main__``, as the docs' *Defining
your app at the top level of your program* advises; its one task is named explicitly
(``bench_ledger``) and calls :func:`bench.ledger.record`.

Connector: ``PsycopgConnector`` (psycopg 3) whose pool holds CONCURRENCY + 1 connections
(default 17): the docs' *Mind the size of your PostgreSQL pool* says that the shorter the
jobs, the more the pool needs "as many connections as your concurrency (plus one)"; the
LISTEN connection is apart from it. Schema: ``app.schema_manager.apply_schema()`` (what
``procrastinate schema --apply`` runs) into the run's scratch database.

Producer (:func:`defer`): the synchronous API (the connector hands it a
``SyncPsycopgConnector``), one batch insert per :data:`CHUNK` tasks through
``app.job_manager.batch_defer_jobs`` (what ``Task.batch_defer`` calls), each job built by
``task.configure(schedule_at=<due>)``, so each keeps its own due time.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

from procrastinate import App, PsycopgConnector
from procrastinate.jobs import Job
from procrastinate.tasks import Task

from . import ledger

TASK_NAME = "bench_ledger"
#: jobs per batch insert
CHUNK = 5000


def record(i: int, due: int) -> None:
    """The task: the shared body."""
    ledger.record(i, due)


def make_app(dsn: str, concurrency: int = 16) -> tuple[App, Task[..., None, ...]]:
    """An app on ``dsn`` with a pool of ``concurrency`` + 1 connections, and its task."""
    size = concurrency + 1
    app = App(connector=PsycopgConnector(conninfo=dsn, min_size=size, max_size=size))
    return app, app.task(name=TASK_NAME)(record)


def apply_schema(dsn: str) -> None:
    """Create Procrastinate's schema in the database ``dsn``."""
    app, _ = make_app(dsn, 1)
    with app.open():
        app.schema_manager.apply_schema()


def defer(dsn: str, tasks: Sequence[tuple[int, int]]) -> None:
    """Defer ``(i, due_ms)`` tasks, each scheduled at ``due_ms`` (epoch ms)."""
    app, task = make_app(dsn, 1)
    with app.open():
        for start in range(0, len(tasks), CHUNK):
            app.job_manager.batch_defer_jobs([_job(task, i, due)
                                              for i, due in tasks[start:start + CHUNK]])


def _job(task: Task[..., None, ...], i: int, due: int) -> Job:
    at = datetime.fromtimestamp(due / 1000, UTC)
    return task.configure(schedule_at=at).make_new_job(i=i, due=due)
