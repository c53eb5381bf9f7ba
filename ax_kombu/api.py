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
:mod:`ax_kombu.store.tasks`).
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Self

from ax_kombu import recurring
from ax_kombu.config import Settings
from ax_kombu.core import cron, states
from ax_kombu.core.ids import LeasedIds
from ax_kombu.core.states import Status
from ax_kombu.exceptions import (
    IllegalTransition,
    JobNotFound,
    TaskNotFound,
    ValidationError,
    WaitTimeout,
)
from ax_kombu.recurring import JobView
from ax_kombu.store import Store, gates, transitions
from ax_kombu.store import jobs as job_store
from ax_kombu.store.archive import fetch_archived
from ax_kombu.store.leases import StoreLessor
from ax_kombu.store.tasks import attempts_of, fetch_task, insert_tasks
from ax_kombu.store.transitions import Attempt
from ax_kombu.validation import (
    MAX_TASK_TYPE,
    broadcast_row,
    build_row,
    check_route,
    check_text,
    shard_count,
    shard_rows,
    show,
)

_TASK_ARGS = frozenset({"task_type", "payload", "run_at", "delay", "priority", "biz_key",
                        "max_retry", "timeout_ms", "processor", "callback_url", "trace_id",
                        "order_key", "order_policy", "shards"})


class TaskId(int):
    """A task id (an ``int``) that also says whether this call created the task."""

    created: bool
    #: with ``shards=N``: the ids of all N shards, in shard order (this id is shard 0's)
    shards: tuple[int, ...]

    def __new__(cls, value: int, created: bool = True, shards: tuple[int, ...] = ()) -> Self:
        obj = super().__new__(cls, value)
        obj.created = created
        obj.shards = shards
        return obj

    @property
    def duplicate(self) -> bool:
        """True when the call matched an existing task and created nothing."""
        return not self.created


@dataclass(frozen=True)
class TaskView:
    """A read-only snapshot of one task row."""

    task_id: int
    task_type: str
    status: Status
    trigger_time: int
    priority: str
    payload: Any
    retry_count: int
    max_retry: int
    timeout_ms: int
    processor_name: str | None
    callback_url: str | None
    biz_key: str | None
    fingerprint: str
    trace_id: str
    attempt: int
    last_run_node: str | None
    created_at: int
    dispatched_at: int | None
    started_at: int | None
    finished_at: int | None
    last_error: str | None
    #: the recurring job this task is an occurrence of, and the occurrence's time (epoch ms)
    job: str | None = None
    scheduled_at: int | None = None
    order_key: str | None = None
    shard_index: int | None = None
    shard_total: int | None = None
    #: a shard of ``shards="workers"``: the worker it was sent to
    target_node: str | None = None
    #: the processor's return value (SUCCESS; None if it returned None or it was not stored)
    result: Any = None
    #: where it runs: 'ax' (a processor), 'callback', 'celery' or 'celery_ax' (a Celery
    #: worker with the AxBootstep); see ax_kombu.store.schema
    runner: str = "ax"
    #: every ended attempt, oldest first (one still under way is not listed: the row's
    #: ``attempt``, ``last_run_node`` and ``started_at`` describe it)
    attempts: tuple[Attempt, ...] = ()
    #: the task was moved to the archive tables (``ax archive``, ``AX_RETENTION``)
    archived: bool = False

    @classmethod
    def from_row(cls, row: Mapping[str, Any], attempts: Sequence[Mapping[str, Any]] = (),
                 archived: bool = False) -> TaskView:
        data = {k: row[k] for k in cls.__dataclass_fields__ if k not in ("attempts", "archived")}
        data["status"] = Status(row["status"])
        data["payload"] = json.loads(row["payload"])
        data["result"] = json.loads(row["result"]) if row.get("result") is not None else None
        return cls(**data, attempts=tuple(Attempt(**a) for a in attempts), archived=archived)


#: one ended attempt of a task, as ``TaskView.attempts`` lists them (see ax_kombu.store.schema)
AttemptView = Attempt


class Client:
    """A producer's handle on one store. Thread-safe; one per process is enough."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.store = Store(settings)
        owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.ids = LeasedIds(StoreLessor(self.store.engine), owner,
                             settings.node_lease_s * 1000, self.store.now_ms)
        self.pid = os.getpid()

    def enqueue(self, task_type: str, payload: Any = None, **options: Any) -> TaskId:
        """Create one task; see :func:`ax_kombu.enqueue` for the arguments.

        Returns:
            The task id; ``.created`` is False when it matched an existing task.
        Raises:
            ValidationError: bad input; nothing was written.
        """
        return self.enqueue_many([dict(options, task_type=task_type, payload=payload)])[0]

    def enqueue_to(self, runner: str, task_type: str, payload: Any = None,
                   **options: Any) -> TaskId:
        """Create one task run by ``runner``, a Celery one (``'celery'``, ``'celery_ax'``:
        see :mod:`ax_kombu.store.schema`), with ``processor='celery:<queue>'``; else as
        :meth:`enqueue`. For :mod:`ax_kombu.celery`, the one writer of Celery-bound tasks.

        Raises:
            ValidationError: bad input; nothing was written.
        """
        return self._enqueue([dict(options, task_type=task_type, payload=payload)], runner)[0]

    def enqueue_many(self, items: Iterable[Mapping[str, Any]]) -> list[TaskId]:
        """Create many tasks in one transaction; each item holds enqueue's arguments.

        Raises:
            ValidationError: any item is invalid (a processor name shaped like a Celery
                route too, see the module docstring); nothing was written.
        """
        return self._enqueue(items, None)

    def _enqueue(self, items: Iterable[Mapping[str, Any]], runner: str | None) -> list[TaskId]:
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
        results = iter(insert_tasks(self.store.engine, rows, self.settings.dedup_window_ms,
                                    wake_before_ms=now + self.settings.preload_window_ms))
        out = []
        for group in groups:
            got = [next(results) for _ in group]
            out.append(TaskId(got[0][0], got[0][1],
                              tuple(t for t, _ in got) if group[0].get("shard_total") else ()))
        return out

    def _rows(self, now: int, index: int, item: Mapping[str, Any],
              runner: str | None) -> list[dict[str, Any]]:
        """The row(s) of one item: one, or one per shard."""
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
        row = build_row(self.settings, now, args.pop("task_type"), args.pop("payload", None),
                        runner=runner, **args)
        check_route(row)
        if shards == "workers":
            return [broadcast_row(row)]
        return [row] if shards is None else shard_rows(row, int(shards))

    def get(self, task_id: int) -> TaskView:
        """The task ``task_id``; from the archive tables (``archived=True``) if it was
        archived.

        Raises:
            TaskNotFound: no such task.
        """
        with self.store.engine.connect() as conn:
            row = fetch_task(conn, int(task_id))
            history = attempts_of(conn, int(task_id)) if row is not None else []
            cold = fetch_archived(conn, int(task_id)) if row is None else None
        if cold is not None:
            return TaskView.from_row(cold[0], cold[1], archived=True)
        if row is None:
            raise TaskNotFound(f"no task {task_id}")
        return TaskView.from_row(dict(row._mapping), history)

    def wait(self, task_id: int, timeout: float = 30.0) -> TaskView:
        """Wait until the task has finished (SUCCESS, FAILED or CANCELLED); returns it.

        Polls the store, starting at 10 ms and backing off to 0.5 s.

        Raises:
            TaskNotFound: no such task.
            WaitTimeout: it had not finished after ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        pause = 0.01
        while True:
            view = self.get(task_id)
            if view.status in states.FINAL:
                return view
            left = deadline - time.monotonic()
            if left <= 0:
                raise WaitTimeout(f"task {task_id} is still {view.status} after {timeout} s")
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.5)

    def cancel(self, task_id: int) -> TaskView:
        """Cancel a task that has not finished.

        Raises:
            TaskNotFound: no such task.
            IllegalTransition: the task is already SUCCESS, FAILED or CANCELLED.
        """
        with self.store.engine.begin() as conn:
            moved = transitions.transition(conn, [int(task_id)], states.ACTIVE, Status.CANCELLED,
                                      values={"finished_at": self.store.now_ms()})
        view = self.get(task_id)
        if not moved:
            raise IllegalTransition(f"task {task_id} is {view.status}; only a task that has "
                                    "not finished can be cancelled")
        return view

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

    # -- cluster-wide limits (ax_kombu.store.gates) ---------------------------------------------

    def set_limit(self, task_type: str, max_running: int | None) -> None:
        """Set or clear (None) the limit of ``task_type``; see :func:`ax_kombu.set_limit`.

        Raises:
            ValidationError: bad task type or limit; nothing was written.
        """
        task_type = check_text("task_type", task_type, MAX_TASK_TYPE)
        if max_running is not None and (isinstance(max_running, bool)
                                        or not isinstance(max_running, int)
                                        or not 1 <= max_running <= 1_000_000):
            raise ValidationError(f"max_running must be an int within 1..1000000 or None, "
                                  f"got {show(max_running)}")
        with self.store.engine.begin() as conn:
            gates.set_limit(conn, task_type, max_running, self.store.now_ms())

    def limits(self) -> dict[str, int]:
        """Every limit: task type → most DISPATCHING or RUNNING at once."""
        with self.store.engine.connect() as conn:
            return gates.list_limits(conn)

    def declare_periodic(self) -> list[str]:
        """Write every ``@ax.periodic`` job declared so far; returns their names."""
        for name, spec in recurring.declared().items():
            self.schedule(name, **spec)
        return sorted(recurring.declared())

    def close(self) -> None:
        self.ids.release()
        self.store.close()
