"""The SQL of recurring jobs: the ``ax_job`` rows, and their occurrences as tasks.

Exactly one task per ``(job, occurrence)`` holds with any number of schedulers, across
restarts and crashes, because of the store, not of a lock in memory: an occurrence is
inserted with ``ON CONFLICT (job, scheduled_at) DO NOTHING`` against the partial unique
index ``uq_ax_task_occurrence`` (:mod:`ax_kombu.store.schema`). Two schedulers that plan
the same occurrence write one row; the other insert does nothing.

Schedulers also lock the job rows they work on (``FOR UPDATE SKIP LOCKED``, in name
order), which keeps them from doing the same work twice and makes a misfire decision
(which missed occurrences to run, which to cancel) one scheduler's, whole. A job row
another transaction holds (the other scheduler's pass, a ``schedule()`` call) is left to
the next pass instead of waited for, so no lock on one job ever holds up a scheduler's
housekeeping. On SQLite every write transaction already holds the database's one write
lock.

A job whose row cannot be planned (:func:`mark_broken`) carries the reason in ``broken``
and is no longer due until ``schedule()`` sets it again.

Undispatched occurrences are CREATED, DELAYED or READY; once claimed (DISPATCHING) an
occurrence is no longer the job's to remove: pausing, changing or removing a job deletes
only undispatched ones — each by one conditional ``DELETE``, so a racing claim either
took the row first (it runs) or finds nothing (it does not).
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Connection, Row, delete, select, text, update
from sqlalchemy.dialects import postgresql, sqlite

from ax_kombu.core.gating import SERIAL_PREFIX
from ax_kombu.core.runners import runner_for
from ax_kombu.core.states import Status
from ax_kombu.core.values import initial_status
from ax_kombu.store import transitions
from ax_kombu.store.schema import jobs, tasks

UNDISPATCHED = (Status.CREATED.value, Status.DELAYED.value, Status.READY.value)
#: longest reason stored in ``ax_job.broken``
MAX_REASON = 1000
_OCCURRENCE_WHERE = text("job IS NOT NULL")


def occurrence_fingerprint(job: str, scheduled_at: int) -> str:
    """An occurrence's fingerprint: unique to it, so the enqueue-time duplicate check
    (same type and payload within a few seconds) never matches a job's occurrences and a
    one-off task is never taken for one."""
    return hashlib.blake2b(f"job\0{job}\0{scheduled_at}".encode(), digest_size=16).hexdigest()


def occurrence_row(job: Row[Any], task_id: int, scheduled_at: int, trigger: int,
                   now_ms: int) -> dict[str, Any]:
    """The task row of ``job``'s occurrence at ``scheduled_at``, due at ``trigger``: the
    job's task fields, its own fingerprint, and its strategy's gate. The scheduler's
    materialiser writes each occurrence so, and :meth:`ax_kombu.api.Client.run_job_now`
    one due at once."""
    return {
        "task_id": task_id, "task_type": job.task_type,
        "trigger_time": trigger, "status": initial_status(trigger, now_ms),
        "priority": job.priority,
        "retry_count": 0, "max_retry": job.max_retry, "timeout_ms": job.timeout_ms,
        "processor_name": job.processor_name, "callback_url": job.callback_url,
        "payload": job.payload, "biz_key": None,
        "fingerprint": occurrence_fingerprint(job.name, scheduled_at),
        "trace_id": uuid.uuid4().hex, "attempt": 0, "created_at": now_ms,
        "job": job.name, "scheduled_at": scheduled_at, **_strategy(job, scheduled_at),
    }


def _strategy(job: Row[Any], scheduled_at: int) -> dict[str, Any]:
    """The gate of an occurrence (:mod:`ax_kombu.core.gating`): a serial job's occurrences
    share one order key, in occurrence order; cover and discard are checked at claim."""
    if job.strategy == "serial":
        return {"gate": "order", "order_key": SERIAL_PREFIX + job.name,
                "order_seq": scheduled_at}
    if job.strategy in ("cover", "discard"):
        return {"gate": job.strategy}
    return {}


# -- job rows ------------------------------------------------------------------------------------


def get_job(conn: Connection, name: str, *, lock: bool = False) -> Row[Any] | None:
    """The job ``name`` (locked for this transaction with ``lock``), or None."""
    stmt = select(jobs).where(jobs.c.name == name)
    if lock:
        stmt = stmt.with_for_update()
    return conn.execute(stmt).first()


def list_jobs(conn: Connection) -> list[Row[Any]]:
    """Every job, by name."""
    return list(conn.execute(select(jobs).order_by(jobs.c.name)))


def insert_job(conn: Connection, values: Mapping[str, Any]) -> bool:
    """Insert a job unless one of that name exists; True if this call inserted it."""
    stmt = _dialect_insert(conn, jobs).values(**values).on_conflict_do_nothing(
        index_elements=["name"])
    return bool(conn.execute(stmt).rowcount)


def update_job(conn: Connection, name: str, values: Mapping[str, Any]) -> bool:
    """Set ``values`` on the job ``name``; True if it exists."""
    return bool(conn.execute(update(jobs).where(jobs.c.name == name).values(**values)).rowcount)


def delete_job(conn: Connection, name: str) -> bool:
    """Delete the job row ``name``; True if it existed."""
    return bool(conn.execute(delete(jobs).where(jobs.c.name == name)).rowcount)


def due_jobs(conn: Connection, horizon_ms: int, limit: int,
             wait: bool = False) -> list[Row[Any]]:
    """Active jobs, not broken, whose next occurrence is at or before ``horizon_ms``,
    locked for this transaction, in name order; rows locked by another transaction are
    skipped (the next pass takes them), or with ``wait`` waited for (and read again once
    that transaction has ended: a job it moved past the horizon is not returned)."""
    stmt = (select(jobs)
            .where(jobs.c.paused.is_(False), jobs.c.next_fire_at.is_not(None),
                   jobs.c.next_fire_at <= horizon_ms, jobs.c.broken.is_(None))
            .order_by(jobs.c.name).limit(limit).with_for_update(skip_locked=not wait))
    return list(conn.execute(stmt))


def mark_broken(conn: Connection, name: str, reason: str) -> bool:
    """Record why the job ``name`` cannot be planned; it is no longer due (see
    :func:`due_jobs`) until ``schedule()`` clears the mark. True if the job exists."""
    return update_job(conn, name, {"broken": reason[:MAX_REASON]})


# -- occurrences ---------------------------------------------------------------------------------


def insert_occurrences(conn: Connection, rows: Sequence[Mapping[str, Any]]) -> list[int]:
    """Insert occurrence tasks (complete rows with ``job`` and ``scheduled_at``); one that
    exists already is skipped. Returns the ids of the rows this call created."""
    if not rows:
        return []
    stmt = (_dialect_insert(conn, tasks)
            .on_conflict_do_nothing(index_elements=["job", "scheduled_at"],
                                    index_where=_OCCURRENCE_WHERE)
            .returning(tasks.c.task_id))
    # an occurrence takes the runner its job's route names (ax_job stores no runner)
    return [r[0] for r in conn.execute(stmt, [
        {"runner": runner_for(r.get("processor_name"), r.get("callback_url")), **r}
        for r in rows])]


def latest_occurrences(conn: Connection, job: str, limit: int) -> list[Row[Any]]:
    """The job's last ``limit`` occurrences (whole task rows), newest first."""
    stmt = (select(tasks).where(tasks.c.job == job)
            .order_by(tasks.c.scheduled_at.desc()).limit(limit))
    return list(conn.execute(stmt))


def pending_occurrences(conn: Connection, job: str, since_ms: int,
                        before_ms: int) -> list[tuple[int, int]]:
    """``(task_id, scheduled_at)`` of the job's undispatched occurrences scheduled in
    ``[since_ms, before_ms)`` (one range of the unique index)."""
    stmt = (select(tasks.c.task_id, tasks.c.scheduled_at)
            .where(tasks.c.job == job, tasks.c.scheduled_at >= since_ms,
                   tasks.c.scheduled_at < before_ms, tasks.c.status.in_(UNDISPATCHED)))
    return [(r[0], r[1]) for r in conn.execute(stmt)]


def cancel_occurrences(conn: Connection, task_ids: Sequence[int], now_ms: int,
                       reason: str) -> list[int]:
    """Cancel undispatched occurrences (a claim that got there first wins); returns those
    cancelled."""
    return transitions.transition(conn, list(task_ids),
                                  [Status(s) for s in UNDISPATCHED], Status.CANCELLED,
                                  values={"finished_at": now_ms, "last_error": reason})


def retrigger(conn: Connection, moves: Sequence[tuple[int, int]]) -> int:
    """Set ``(task_id, trigger_time)`` on undispatched occurrences (catch-ups); returns how
    many moved (a claim that got there first keeps its row as it was)."""
    moved = 0
    for task_id, trigger in moves:
        moved += conn.execute(
            update(tasks).where(tasks.c.task_id == task_id, tasks.c.status.in_(UNDISPATCHED))
            .values(trigger_time=trigger)).rowcount or 0
    return moved


def drop_undispatched(conn: Connection, job: str, from_ms: int | None = None) -> list[int]:
    """Delete the job's undispatched occurrences (scheduled at or after ``from_ms`` if
    given); returns their scheduled times."""
    stmt = delete(tasks).where(tasks.c.job == job, tasks.c.status.in_(UNDISPATCHED))
    if from_ms is not None:
        stmt = stmt.where(tasks.c.scheduled_at >= from_ms)
    return [r[0] for r in conn.execute(stmt.returning(tasks.c.scheduled_at))]


def _dialect_insert(conn: Connection, table: Any) -> Any:
    """An INSERT that knows ``ON CONFLICT`` (PostgreSQL and SQLite, the two stores)."""
    return (postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert)(table)
