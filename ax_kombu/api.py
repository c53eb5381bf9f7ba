"""The producer side: validate a task, protect against duplicates, hand it to the store.

Guarantees of :meth:`Client.enqueue` / :meth:`Client.enqueue_many`:

* Bad input raises :class:`ValidationError` and writes nothing; a batch is
  validated whole before anything is written.
* Where a task runs is stored with it (``runner``: an ax processor or a callback);
  a processor name shaped like a Celery route (``celery:…``) is refused: only
  :mod:`ax_kombu.celery` routes a task to Celery (:meth:`Client.enqueue_to`).
* A call that returns has committed its task(s): a crash after it loses
  nothing.
* ``biz_key``: the same ``(task_type, biz_key)`` enqueued again returns the
  existing id and creates nothing.
* Fingerprint: a task with the same type and payload (key order does not
  matter) whose trigger time is less than ``dedup_window_ms`` from a
  non-cancelled one is not created again; the existing id comes back with
  ``created=False``.
Both hold across concurrent producers in many processes (see
:mod:`ax_kombu.store.enqueue`).

The client's other parts are mixed in: moving and cancelling tasks
(:mod:`ax_kombu.moving`), and the cluster-wide controls, limits, pauses and alerts
(:mod:`ax_kombu.controls`).
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext
from datetime import datetime
from typing import Any

from sqlalchemy import Connection

from ax_kombu import recurring
from ax_kombu.config import Settings
from ax_kombu.controls import Controls
from ax_kombu.core import cron, states
from ax_kombu.core.ids import ReservedIds
from ax_kombu.core.values import show
from ax_kombu.exceptions import (
    JobNotFound,
    TaskNotFound,
    ValidationError,
    WaitTimeout,
)
from ax_kombu.moving import Moving
from ax_kombu.recurring import JobView
from ax_kombu.store import Store, moves
from ax_kombu.store import jobs as job_store
from ax_kombu.store.archive import fetch_archived
from ax_kombu.store.borrowed import Borrowing
from ax_kombu.store.enqueue import KEY_POLICY, Written, insert_tasks, write_tasks
from ax_kombu.store.leases import StoreReserver
from ax_kombu.store.tasks import attempts_of, fetch_task
from ax_kombu.store.waits import SAFETY_POLL_S, EndListener, Flag, Polling
from ax_kombu.validation import broadcast_row, build_row, check_route, shard_count, shard_rows
from ax_kombu.views import TaskId, TaskView

_TASK_ARGS = frozenset({"task_type", "payload", "run_at", "delay", "priority", "biz_key",
                        "max_retry", "timeout_ms", "processor", "callback_url", "trace_id",
                        "order_key", "order_policy", "shards", "unique", "on_conflict"})
_UNIQUE = ("always", "pending")
_ON_CONFLICT = ("keep", "replace")


def _key_policy(unique: Any, on_conflict: Any, biz_key: Any,
                shards: Any) -> tuple[str, str] | None:
    """An item's :data:`~ax_kombu.store.enqueue.KEY_POLICY`, None for the default.

    Raises:
        ValidationError: an unknown value, a policy without a biz_key, or with shards.
    """
    if unique not in _UNIQUE:
        raise ValidationError(f"unique must be one of {', '.join(_UNIQUE)}, got {show(unique)}")
    if on_conflict not in _ON_CONFLICT:
        raise ValidationError(f"on_conflict must be one of {', '.join(_ON_CONFLICT)}, got "
                              f"{show(on_conflict)}")
    if (unique, on_conflict) == ("always", "keep"):
        return None
    if biz_key is None:
        raise ValidationError("unique= and on_conflict= apply to a biz_key; give one")
    if shards is not None:
        raise ValidationError("unique= and on_conflict= cannot be combined with shards")
    return (unique, on_conflict)


def item_rows(settings: Settings, now: int, index: int, item: Mapping[str, Any],
              runner: str | None) -> list[dict[str, Any]]:
    """The validated row(s) of one enqueue item (``index`` in its batch, for messages):
    one, or one per shard; ids not yet given.

    Raises:
        ValidationError: the item is invalid.
    """
    if not isinstance(item, Mapping):
        raise ValidationError(f"item {index} is not a mapping of enqueue arguments")
    unknown = set(item) - _TASK_ARGS
    if unknown:
        raise ValidationError(f"item {index}: unknown argument(s) "
                              f"{', '.join(sorted(show(k) for k in unknown))}")
    if "task_type" not in item:
        raise ValidationError(f"item {index} has no task_type")
    args = dict(item)
    shards = shard_count(args.pop("shards", None))
    policy = _key_policy(args.pop("unique", "always"), args.pop("on_conflict", "keep"),
                         args.get("biz_key"), shards)
    row = build_row(settings, now, args.pop("task_type"), args.pop("payload", None),
                    runner=runner, **args)
    check_route(row)
    if policy is not None:
        row[KEY_POLICY] = policy
    if shards == "workers":
        return [broadcast_row(row)]
    return [row] if shards is None else shard_rows(row, int(shards))


def task_ids(groups: list[list[dict[str, Any]]], written: list[Written]) -> list[TaskId]:
    """What each item of a batch returns: ``written`` holds one result per row, in the
    order of ``groups`` (each item's rows, one or one per shard)."""
    results = iter(written)
    out = []
    for group in groups:
        got = [next(results) for _ in group]
        shards = tuple(w.task_id for w in got) if group[0].get("shard_total") else ()
        out.append(TaskId(got[0].task_id, got[0].created, shards, got[0].replaced))
    return out


def read_task(conn: Connection, task_id: int) -> TaskView:
    """The task ``task_id`` read through ``conn``; from the archive tables
    (``archived=True``) if it was archived.

    Raises:
        TaskNotFound: no such task.
    """
    row = fetch_task(conn, int(task_id))
    history = attempts_of(conn, int(task_id)) if row is not None else []
    moved = moves.moves_of(conn, int(task_id)) if row is not None else []
    cold = fetch_archived(conn, int(task_id)) if row is None else None
    if cold is not None:
        return TaskView.from_row(cold[0], cold[1], archived=True)
    if row is None:
        raise TaskNotFound(f"no task {task_id}")
    return TaskView.from_row(dict(row._mapping), history, moves=moved)


class Client(Moving, Controls):
    """A producer's handle on one store. Thread-safe; one per process is enough."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.store = Store(settings)
        owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.ids = ReservedIds(StoreReserver(self.store.engine), owner,
                             settings.id_reservation_s * 1000, self.store.now_ms)
        self.pid = os.getpid()
        self.borrowing = Borrowing(self.store.engine)
        self._listener: tuple[int, EndListener] | None = None  # (its process id, it)
        self._listener_lock = threading.Lock()

    def enqueue(self, task_type: str, payload: Any = None, *, connection: Any = None,
                **options: Any) -> TaskId:
        """Create one task; see :func:`ax_kombu.enqueue` for the arguments.

        Returns:
            The task id; ``.created`` is False when it matched an existing task.
        Raises:
            ValidationError: bad input; nothing was written.
        """
        item = dict(options, task_type=task_type, payload=payload)
        return self.enqueue_many([item], connection=connection)[0]

    def enqueue_to(self, runner: str, task_type: str, payload: Any = None,
                   **options: Any) -> TaskId:
        """Create one task run by ``runner``, a Celery one (``'celery'``, ``'celery_ax'``:
        see :mod:`ax_kombu.store.schema`), with ``processor='celery:<queue>'``; else as
        :meth:`enqueue`. For :mod:`ax_kombu.celery`, the one writer of Celery-bound tasks.

        Raises:
            ValidationError: bad input; nothing was written.
        """
        return self._enqueue([dict(options, task_type=task_type, payload=payload)], runner)[0]

    def enqueue_many(self, items: Iterable[Mapping[str, Any]], *,
                     connection: Any = None) -> list[TaskId]:
        """Create many tasks in one transaction — this call's own, or with ``connection``
        the caller's (:mod:`ax_kombu.store.borrowed`); each item holds enqueue's arguments.

        Raises:
            ValidationError: any item is invalid (a processor name shaped like a Celery
                route too, see the module docstring), or ``connection`` cannot be used;
                nothing was written.
        """
        return self._enqueue(items, None, connection)

    def _enqueue(self, items: Iterable[Mapping[str, Any]], runner: str | None,
                 connection: Any = None) -> list[TaskId]:
        if isinstance(items, (str, bytes, Mapping)) or not isinstance(items, Iterable):
            raise ValidationError("enqueue_many takes an iterable of mappings of enqueue "
                                  f"arguments, got {type(items).__name__}")
        now = self.store.now_ms()
        groups = [self._rows(now, i, item, runner) for i, item in enumerate(items)]
        rows = [row for group in groups for row in group]
        if not rows:
            return []
        for row, task_id in zip(rows, self.ids.next_ids(len(rows)), strict=True):
            row["task_id"] = task_id
        args = (rows, self.settings.dedup_window_ms, now + self.settings.preload_window_ms, now)
        if connection is None:
            written = insert_tasks(self.store.engine, *args)
        else:
            with self.borrowing.connection(connection) as conn:
                written = write_tasks(conn, *args)
        return task_ids(groups, written)

    def _rows(self, now: int, index: int, item: Mapping[str, Any],
              runner: str | None) -> list[dict[str, Any]]:
        """The row(s) of one item: one, or one per shard."""
        return item_rows(self.settings, now, index, item, runner)

    def get(self, task_id: int) -> TaskView:
        """The task ``task_id``; from the archive tables (``archived=True``) if it was
        archived.

        Raises:
            TaskNotFound: no such task.
        """
        with self.store.engine.connect() as conn:
            return read_task(conn, task_id)

    def wait(self, task_id: int, timeout: float = 30.0) -> TaskView:
        """Wait until the task has finished (SUCCESS, FAILED or CANCELLED); returns it.

        On PostgreSQL the end's notification wakes the wait (``ax_ended``: see
        :mod:`ax_kombu.store.waits`; one listening connection per client, opened by the
        first wait), with a read of the row at least every second whatever it hears.
        On SQLite it polls the store, starting at 10 ms and backing off to 0.5 s.

        Raises:
            TaskNotFound: no such task.
            WaitTimeout: it had not finished after ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        with self._watch(task_id) as woken:
            while True:
                woken.clear()  # before the read: an end after it sets the flag again
                view = self.get(task_id)
                if view.status in states.FINAL:
                    return view
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WaitTimeout(f"task {task_id} is still {view.status} after {timeout} s")
                woken.wait(min(left, SAFETY_POLL_S))

    def _watch(self, task_id: int) -> AbstractContextManager[Flag]:
        """A wait's flag: registered with this process's listener of ends (made by the
        first wait), or on SQLite a :class:`~ax_kombu.store.waits.Polling`."""
        if self.store.engine.dialect.name != "postgresql":
            return nullcontext(Polling())
        with self._listener_lock:
            if self._listener is None or self._listener[0] != os.getpid():
                self._listener = (os.getpid(), EndListener(self.store.engine))
            return self._listener[1].watch(task_id)

    # -- recurring jobs (ax_kombu.recurring) -----------------------------------------------------

    def schedule(self, name: str, task_type: str, payload: Any = None, *,
                 cron: str | None = None, every: Any = None, tz: str = "UTC",
                 misfire: str = "fire_once", misfire_grace_s: Any = None,
                 strategy: str = "parallel", **options: Any) -> JobView:
        """Create or update a recurring job; see :func:`ax_kombu.schedule`.

        Raises:
            ValidationError: bad input; nothing was written.
        """
        now = self.store.now_ms()
        values = recurring.build_job(self.settings, now, name, task_type, payload,
                                     cron_expr=cron, every=every, tz=tz, misfire=misfire,
                                     misfire_grace_s=misfire_grace_s, strategy=strategy,
                                     **options)
        recurring.schedule_job(self.store.engine, values, now)
        return self.job(name)

    def pause(self, name: str) -> JobView:
        """Pause a job (JobNotFound if there is none)."""
        recurring.pause_job(self.store.engine, name, self.store.now_ms())
        return self.job(name)

    def resume(self, name: str) -> JobView:
        """Resume a paused job (JobNotFound if there is none)."""
        recurring.resume_job(self.store.engine, name, self.store.now_ms())
        return self.job(name)

    def run_job_now(self, name: str) -> int:
        """Run the job ``name`` once, now: one occurrence due at once, gated by the job's
        strategy as a scheduled one is (paused or not); returns its task id.

        Raises:
            JobNotFound: no such job.
        """
        task_id = self.ids.next_ids(1)[0]
        recurring.run_job_now(self.store.engine, name, task_id)
        return task_id

    def unschedule(self, name: str) -> int:
        """Remove a job and its undispatched occurrences; returns how many occurrences
        were removed (JobNotFound if there is no such job)."""
        return recurring.unschedule_job(self.store.engine, name)

    def job(self, name: str) -> JobView:
        """The job ``name``.

        Raises:
            JobNotFound: no such job.
        """
        return recurring.view(self._job_row(name), self.store.now_ms())

    def _job_row(self, name: str) -> dict[str, Any]:
        """The stored row of the job ``name``. Raises JobNotFound."""
        with self.store.engine.connect() as conn:
            row = job_store.get_job(conn, name)
        if row is None:
            raise JobNotFound(f"no recurring job {name!r}")
        return dict(row._mapping)

    def jobs(self) -> list[JobView]:
        """Every recurring job, by name."""
        with self.store.engine.connect() as conn:
            rows = job_store.list_jobs(conn)
        now = self.store.now_ms()
        return [recurring.view(dict(r._mapping), now) for r in rows]

    def next_fires(self, name: str, count: int = 5) -> list[datetime]:
        """The next ``count`` fire times of ``name`` (aware, in the job's zone), paused or not.

        Raises:
            JobNotFound: no such job.
            ValidationError: ``count`` is not within 1..1000.
        """
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 1000:
            raise ValidationError(f"count must be an int within 1..1000, got {show(count)}")
        row = self._job_row(name)
        times = cron.upcoming(recurring.job_schedule(row), self.store.now_ms(), count)
        return [cron.to_datetime(t, row["tz"]) for t in times]

    def occurrences(self, name: str, limit: int = 20) -> list[TaskView]:
        """The job's latest occurrences as tasks, newest first (any status)."""
        with self.store.engine.connect() as conn:
            rows = job_store.latest_occurrences(conn, name, limit)
        return [TaskView.from_row(dict(r._mapping)) for r in rows]

    def declare_periodic(self) -> list[str]:
        """Write every ``@ax.periodic`` job declared so far; returns their names."""
        for name, spec in recurring.declared().items():
            self.schedule(name, **spec)
        return sorted(recurring.declared())

    def close(self) -> None:
        if self._listener is not None:
            self._listener[1].close()
        self.borrowing.close()
        self.ids.release()
        self.store.close()
