"""The claim: due DELAYED/READY tasks → DISPATCHING for one scheduler node, attempt + 1.

The one statement behind exactly-once dispatch per attempt: a row moves for
exactly one claimer, and every claim carries a new attempt number (the fencing
token workers check).

Staging and Celery: an ax task may be claimed up to ``claim_lead_ms`` before it is
due (its worker holds it until its trigger time). A Celery-bound task
(``processor_name`` ``celery:<queue>`` or ``celery+ax:<queue>``, see
:mod:`ax_kombu.broker.celery_wire`) is never staged, since a stock Celery worker cannot
hold a message cheaply: the same statement claims it only once its trigger time is at
or before the claimer's ``now`` (its reading of the database clock). So it is published
no earlier than its trigger time on the scheduler's database clock (the publish follows
the claim), and until then it is DELAYED/READY: ``cancel`` still wins, and a scheduler
that dies holding it leaves it to the recovery scan, not to the ack timeout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, Row, bindparam, text


def celery_bound(column: str) -> str:
    """SQL, true when ``column`` (a ``processor_name``) marks a Celery-bound task (the
    prefixes of :func:`ax_kombu.broker.celery_wire.processor_for`); NULL, not true, when
    ``column`` is NULL."""
    return f"({column} LIKE 'celery:%' OR {column} LIKE 'celery+ax:%')"


def fire_time(column: str = "trigger_time", processor: str = "processor_name") -> str:
    """SQL: the time the scheduler's timing loop is handed for a task, ``:celery_lag`` after
    its trigger time when it is Celery-bound (:func:`celery_bound`), else the trigger time.
    The loop fires every id ``claim_lead_ms`` before the time it was handed; with
    ``:celery_lag`` = ``claim_lead_ms`` a Celery-bound task fires at its trigger time,
    when the claim takes it (see the module docstring)."""
    return f"{column} + CASE WHEN {celery_bound(processor)} THEN :celery_lag ELSE 0 END"


#: in the order of :class:`ax_kombu.broker.messages.TaskMessage`'s first fields (see dispatch.to_message)
_CLAIM_COLUMNS = ("task_id, attempt, task_type, payload, trace_id, trigger_time, timeout_ms, "
                  "priority, retry_count, max_retry, processor_name, callback_url, target_node")

# One conditional UPDATE, as on SQLite. Racing claimers: a row locked by another claim is
# waited for (that claim commits within its one round trip), then its status is tested again,
# so it moves for exactly one of them. Both lock in the same order (primary-key order of
# ANY(:ids)), so two claims do not deadlock; if different plans ever did, PostgreSQL aborts
# one, and its ids go back to be claimed again. This was FOR UPDATE SKIP LOCKED + UPDATE:
# locking first wrote every row twice (lock, then update): claiming 20,000 due rows in
# batches of 500 went from 27–29k to 33–35k rows/s here (three runs each, 2026-12-02).
#
# A Celery-bound row is due by :now, every other one by :due_before (see the module docstring).
_CLAIM = """
    UPDATE ax_task
       SET status = 'DISPATCHING', attempt = attempt + 1,
           last_run_node = :node, dispatched_at = :now{set}
     WHERE task_id {ids} AND status IN ('DELAYED', 'READY')
       AND trigger_time <= CASE WHEN """ + celery_bound("processor_name") + """
                                THEN :now ELSE :due_before END{gate}
 RETURNING """ + _CLAIM_COLUMNS
# The ordinary claim leaves gated tasks to the gated claim (ax_kombu.store.gates): those with
# a gate, or of a type with a limit (one primary-key probe of the small ax_limit table).
_UNGATED = (" AND gate IS NULL AND NOT EXISTS "
            "(SELECT 1 FROM ax_limit AS l WHERE l.task_type = ax_task.task_type)")
_FORMS = {False: {"set": "", "gate": _UNGATED}, True: {"set": ", gated = true", "gate": ""}}

#: PostgreSQL takes the ids as one array; elsewhere they expand into IN (…)
_CLAIM_PG = {g: text(_CLAIM.format(ids="= ANY(:ids)", **f)) for g, f in _FORMS.items()}
_CLAIM_GENERIC = {g: text(_CLAIM.format(ids="IN :ids", **f)).bindparams(
    bindparam("ids", expanding=True)) for g, f in _FORMS.items()}


def claim(conn: Connection, task_ids: Sequence[int], node: str, now_ms: int,
          due_before: int | None = None, *, gated: bool = False) -> list[Row[Any]]:
    """Claim due tasks for dispatch by ``node``: DELAYED/READY → DISPATCHING, attempt + 1.

    One conditional statement for the whole batch: a row moves only if it is
    still DELAYED/READY when the statement reaches it (after waiting for a
    racing claim's lock, PostgreSQL tests it again), so every row is returned
    to exactly one claimer. Rows due after ``due_before`` (default ``now_ms``)
    are left alone.

    Celery-bound tasks are due by ``now_ms``, never ``due_before``: they are not staged
    (see the module docstring).

    Gated tasks (:mod:`ax_kombu.store.gates`) are left alone unless ``gated``: the gated
    claim passes it for the tasks it decided may start, and marks them.

    Returns:
        The claimed rows, with the columns a dispatch message needs.
    """
    if not task_ids:
        return []
    params = {"ids": list(task_ids), "node": node, "now": now_ms,
              "due_before": now_ms if due_before is None else due_before}
    stmt = (_CLAIM_PG if conn.dialect.name == "postgresql" else _CLAIM_GENERIC)[gated]
    return list(conn.execute(stmt, params))


_STILL_HELD = """
    SELECT task_id, """ + fire_time() + """,
           gate IS NOT NULL OR EXISTS (SELECT 1 FROM ax_limit AS l
                                        WHERE l.task_type = ax_task.task_type) AS gated
      FROM ax_task
     WHERE task_id IN :ids AND status IN ('DELAYED', 'READY') AND last_run_node = :node"""
_STILL_HELD_SQL = text(_STILL_HELD).bindparams(bindparam("ids", expanding=True))


def still_held(conn: Connection, task_ids: Sequence[int], node: str, *,
               celery_lag_ms: int = 0) -> list[tuple[int, int, bool]]:
    """Of ``task_ids`` (ids a claim skipped), those ``node`` still holds, unclaimed:
    ``(task_id, trigger_time, gated)`` — gated ones go to the gated claim
    (:mod:`ax_kombu.store.gates`), the others were locked by a racing claim, or are
    Celery-bound and not due yet. A Celery-bound task's time is its trigger time
    plus ``celery_lag_ms`` (:func:`fire_time`)."""
    if not task_ids:
        return []
    params = {"ids": list(task_ids), "node": node, "celery_lag": celery_lag_ms}
    return [(r[0], r[1], bool(r[2])) for r in conn.execute(_STILL_HELD_SQL, params)]
