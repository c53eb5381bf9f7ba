"""Reading tasks back, and the small writes around them: wake-ups, duplicate-check
entries leaving with their task, the attempt history.

New tasks are written by :mod:`ax_kombu.store.enqueue`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Connection, Row, bindparam, select, text

from ax_kombu.store.schema import attempts, fingerprints, tasks

WAKE_CHANNEL = "ax_wakeup"


def wake_schedulers(conn: Connection, first_due_ms: int) -> None:
    """Tell schedulers (on commit) that a task due at ``first_due_ms`` waits to be loaded.

    PostgreSQL only; on SQLite the schedulers poll every 50 ms instead.
    """
    if conn.dialect.name == "postgresql":
        conn.execute(text("SELECT pg_notify(:channel, :first)"),
                     {"channel": WAKE_CHANNEL, "first": str(first_due_ms)})


_FORGET = (fingerprints.delete()
           .where(fingerprints.c.fingerprint.in_(bindparam("fps", expanding=True)),
                  fingerprints.c.task_id.in_(bindparam("ids", expanding=True))))


#: the prune's delete, by the entries' physical addresses: ``ax_fingerprint`` has no key
#: (on PostgreSQL; see :data:`ax_kombu.store.schema.fingerprints`), and matching the chosen
#: entries on their three columns plans a sequential scan of the whole table per batch
_PRUNE = {
    "postgresql": text(
        "DELETE FROM ax_fingerprint WHERE ctid = ANY(ARRAY("
        "SELECT ctid FROM ax_fingerprint WHERE task_id < :created_before "
        "AND trigger_time < :trigger_before LIMIT :limit))"),
    "sqlite": text(
        "DELETE FROM ax_fingerprint WHERE rowid IN ("
        "SELECT rowid FROM ax_fingerprint WHERE task_id < :created_before "
        "AND trigger_time < :trigger_before LIMIT :limit)"),
}


def prune_fingerprints(conn: Connection, created_before_id: int, trigger_before_ms: int,
                       limit: int = 10_000) -> int:
    """Delete up to ``limit`` ``ax_fingerprint`` entries of tasks created before the task id
    ``created_before_id`` (a snowflake of that instant) whose trigger time is before
    ``trigger_before_ms``; returns how many. Such an entry could only make a duplicate of an
    enqueue retried that long after the first, for a trigger time already past. (One
    statement: the addresses it chooses are those its own snapshot sees, and an entry
    another transaction deletes meanwhile is skipped.)"""
    return int(conn.execute(_PRUNE[conn.dialect.name],
                            {"created_before": created_before_id,
                             "trigger_before": trigger_before_ms, "limit": limit}).rowcount)


def forget_fingerprints(conn: Connection, removed: Sequence[tuple[int, str]]) -> None:
    """Delete the ``ax_fingerprint`` entries of tasks about to leave ``ax_task`` (archive,
    purge), given as ``(task_id, fingerprint)``. A task has at most one entry, so the
    two lists select exactly theirs; the delete finds them by task id (PostgreSQL: the BRIN
    on ``task_id``; the entry's trigger time, which its probe needs, is the one asked at
    enqueue, not the task's now) or by fingerprint (SQLite: the primary key's prefix).
    (An entry left behind is harmless: the check joins the task, which is gone.)"""
    if removed:
        conn.execute(_FORGET, {"ids": sorted({r[0] for r in removed}),
                               "fps": sorted({r[1] for r in removed})})


def fetch_task(conn: Connection, task_id: int) -> Row[Any] | None:
    """The whole row of ``task_id``, or None."""
    return conn.execute(select(tasks).where(tasks.c.task_id == task_id)).first()


def attempts_of(conn: Connection, task_id: int) -> list[dict[str, Any]]:
    """The ended attempts of ``task_id``, oldest first: its ``ax_attempt`` rows, and its
    final attempt as the task row holds it (:func:`final_attempt`)."""
    found = [dict(r._mapping) for r in conn.execute(
        select(attempts).where(attempts.c.task_id == task_id).order_by(attempts.c.attempt))]
    row = fetch_task(conn, task_id)
    last = final_attempt(dict(row._mapping)) if row is not None else None
    if last is not None and all(a["attempt"] != last["attempt"] for a in found):
        found.append(last)
    return found


_FINAL = frozenset({"SUCCESS", "FAILED", "CANCELLED"})


def final_attempt(row: Mapping[str, Any]) -> dict[str, Any] | None:
    """A finished task's last attempt, from its row (an ``ax_attempt``-shaped dict); None
    while the task has not finished, or if it never was dispatched."""
    if row["status"] not in _FINAL or not row["attempt"] or row["finished_at"] is None:
        return None
    started = row["started_at"]
    return {"task_id": row["task_id"], "attempt": row["attempt"], "task_type": row["task_type"],
            "node": row["owner_node"], "trigger_time": row["trigger_time"],
            "dispatched_at": row["dispatched_at"], "started_at": started,
            "finished_at": row["finished_at"], "outcome": row["status"],
            "error": None if row["status"] == "SUCCESS" else row["last_error"],
            "duration_ms": row["finished_at"] - started if started is not None else None}


#: copies a finished task's final attempt into the history before ``ax retry`` reuses the row
_KEEP_FINAL = """
INSERT INTO ax_attempt (task_id, attempt, task_type, node, trigger_time, dispatched_at,
                        started_at, finished_at, outcome, error, duration_ms)
SELECT task_id, attempt, task_type, owner_node, trigger_time, dispatched_at, started_at,
       finished_at, status, CASE WHEN status = 'SUCCESS' THEN NULL ELSE last_error END,
       finished_at - started_at
  FROM ax_task WHERE task_id IN :ids AND status IN ('SUCCESS', 'FAILED', 'CANCELLED')
   AND attempt > 0 AND finished_at IS NOT NULL
    ON CONFLICT (task_id, attempt) DO NOTHING"""


def keep_final_attempts(conn: Connection, task_ids: Sequence[int]) -> None:
    """Move the final attempt of each finished task in ``task_ids`` into the history (the
    row is about to start another)."""
    if task_ids:
        conn.execute(text(_KEEP_FINAL).bindparams(bindparam("ids", expanding=True)),
                     {"ids": list(task_ids)})


def cancelled_among(conn: Connection, task_ids: Sequence[int]) -> list[int]:
    """Which of ``task_ids`` are CANCELLED (a worker signals their running processors)."""
    if not task_ids:
        return []
    if conn.dialect.name == "postgresql":  # one array parameter: a third of IN's cost
        return [r[0] for r in conn.execute(_CANCELLED_AMONG_PG, {"ids": list(task_ids)})]
    stmt = select(tasks.c.task_id).where(tasks.c.task_id.in_(list(task_ids)),
                                         tasks.c.status == "CANCELLED")
    return [r[0] for r in conn.execute(stmt)]


_CANCELLED_AMONG_PG = text("SELECT task_id FROM ax_task WHERE task_id = ANY(:ids) "
                           "AND status = 'CANCELLED'")


def cancelled_on(conn: Connection, node: str, lo_ms: int, hi_ms: int) -> list[int]:
    """The CANCELLED tasks ``node`` had fenced (a cancel keeps ``owner_node``) whose trigger
    time is in ``[lo_ms, hi_ms]``: the worker's periodic check for its runs, one range read
    of the ``(status, trigger_time)`` index. Its cost follows the cancelled tasks of that
    window, not the thousands of runs a worker may hold in a burst (which
    :func:`cancelled_among` would send id by id)."""
    return [r[0] for r in conn.execute(_CANCELLED_ON, {"node": node, "lo": lo_ms, "hi": hi_ms})]


_CANCELLED_ON = text("SELECT task_id FROM ax_task WHERE status = 'CANCELLED' "
                     "AND trigger_time >= :lo AND trigger_time <= :hi AND owner_node = :node")
