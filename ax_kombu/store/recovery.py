"""The recovery scans: what the scheduler's housekeeping moves when a worker or a broker
lost a task, and the reads that watch for it.

* :func:`redispatch_unacked` — a DISPATCHING task no worker started within the ack
  timeout (doubling per re-dispatch) goes back to READY, or FAILED past the limit;
* :func:`recover_running` and :func:`recover_orphan_running` — a RUNNING task whose
  worker is dead gets another attempt (counting a retry, unless its run was listed in
  the worker's ``ax_node.listed_runs`` and so never started), or FAILED;
* :func:`waiting_without_consumer` and :func:`oldest_overdue_ms` — read-only figures
  for the liveness checks, the metrics and ``ax status``.

Every statement that moves a row is a compare-and-set: it re-checks the state it moves
from, and records the ended attempt in ``ax_attempt`` first. The scheduler's reads of the
next window are in :mod:`ax_kombu.store.preload`.

**Rows another transaction holds are left for a later pass.** On PostgreSQL each move
first locks the rows it may take (``FOR UPDATE SKIP LOCKED``) and moves only those. A row
locked elsewhere is being moved by its owner (a worker recording the outcome, say), or is
locked by the orphaned transaction of a host cut off between a statement and its COMMIT,
which the server keeps, locks and all, until it notices the dead connection. Waiting on it
would stop the recovery of everything else (and with it the scheduler's housekeeping):
instead the row is looked at again by the next pass (:func:`recover_orphan_running`, the
next ack-timeout scan), when its transaction has committed or been dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from sqlalchemy import Connection, bindparam, text

from ax_kombu.store.claims import off_ax_queues
from ax_kombu.store.schema import UNPARKED
from ax_kombu.store.waits import notify_ended

#: the ack timeout doubles with each re-dispatch of a task, up to 2**MAX_BACKOFF_STEPS times
MAX_BACKOFF_STEPS = 5

_UNACKED_AGE = (f"dispatched_at + (:ack_ms * (CASE WHEN redispatches > {MAX_BACKOFF_STEPS} "
                f"THEN {1 << MAX_BACKOFF_STEPS} ELSE (1 << redispatches) END)) < :now")
# Celery-bound tasks (runner 'celery' or 'celery_ax', see ax_kombu.core.runners) are
# consumed by Celery workers, which no ax heartbeat lists: they are looked at whatever the
# priorities. Each leaves DISPATCHING as soon as its publish is confirmed (the hand-off, in
# ax_kombu.celery), or ('celery_ax') when the AxBootstep of a Celery worker starts it, so
# one still DISPATCHING after the ack timeout was never certainly published, or never
# started.
_UNACKED_WHERE = f"{_UNACKED_AGE} AND (priority IN :priorities OR {off_ax_queues()})"
# The attempt a recovery ends goes to the history first, from the row as it still is; on
# PostgreSQL the rows were locked before (_move_lockable), so a worker's late result waits and
# then finds the row moved (its own history row then loses to this one: ON CONFLICT DO NOTHING).
_RECORD_ENDED = """
INSERT INTO ax_attempt (task_id, attempt, task_type, node, trigger_time, dispatched_at,
                        started_at, finished_at, outcome, error, duration_ms)
SELECT task_id, attempt, task_type, owner_node, trigger_time, dispatched_at, started_at,
       :now, :outcome, {why}, :now - started_at
  FROM ax_task WHERE {where}
    ON CONFLICT (task_id, attempt) DO NOTHING"""


def _record_ended(conn: Connection, where: str, params: dict[str, Any], outcome: str,
                  why: str, *expanding: str, why_sql: str = ":ended_why") -> None:
    """Record in the history the attempts of the rows ``where`` selects, as ``outcome``,
    with ``why`` (or, per row, the SQL expression ``why_sql``, which may name it)."""
    stmt = text(_RECORD_ENDED.format(where=where, why=why_sql)).bindparams(
        *[bindparam(name, expanding=True) for name in expanding])
    conn.execute(stmt, {**params, "outcome": outcome, "ended_why": why})


_REQUEUE_UNACKED = """
UPDATE ax_task
   SET status = CASE WHEN redispatches + 1 < :max_dispatches THEN 'READY' ELSE 'FAILED' END,
       redispatches = redispatches + 1,
       finished_at = CASE WHEN redispatches + 1 < :max_dispatches THEN NULL ELSE :now END,
       last_error = CASE WHEN redispatches + 1 < :max_dispatches THEN last_error
                         ELSE :gave_up END,
       owner_node = NULL
 WHERE {where}
RETURNING task_id, status"""


def redispatch_unacked(conn: Connection, now_ms: int, ack_timeout_ms: int,
                    priorities: Sequence[str], max_dispatches: int) -> list[tuple[int, str]]:
    """DISPATCHING tasks no worker started in time → READY, or FAILED past the limit.

    Bounded re-dispatch: a task's n-th re-dispatch waits ``ack_timeout_ms × 2**n``
    (n capped at MAX_BACKOFF_STEPS) after its last dispatch, and a task sent
    out ``max_dispatches`` times without a start fails with a clear
    ``last_error``. Only tasks of ``priorities`` are looked at: the caller
    passes those whose queue some live worker consumes, so a queue without a
    consumer keeps its one message per task and is never re-published to.
    The next claim gives a requeued task a new attempt, so the message of the
    old attempt, if it is ever delivered, is refused by the worker.

    Celery-bound tasks are looked at whatever ``priorities`` says.

    Returns:
        ``(task_id, new_status)`` pairs.
    """
    gave_up = (f"dispatched {max_dispatches} times and never started by a worker "
               f"(ack timeout {ack_timeout_ms} ms, doubling per dispatch); see AX_MAX_DISPATCHES")
    # no priority is named "": an empty list would render as an untyped empty IN
    params = {"now": now_ms, "ack_ms": ack_timeout_ms, "priorities": list(priorities) or [""],
              "max_dispatches": max_dispatches, "gave_up": gave_up}
    why = (f"not started by a worker within the ack timeout ({ack_timeout_ms} ms, "
           "doubling per dispatch)")
    return _move_lockable(conn, "DISPATCHING", _UNACKED_WHERE, params, ("priorities",),
                          _REQUEUE_UNACKED, lambda w, p, *e: _record_ended(
                              conn, w, p, "UNACKED", why, *e))


def _announced(conn: Connection, moved: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """``moved`` (``(task_id, new_status)`` pairs), its FAILED ones announced to waiters
    (:func:`ax_kombu.store.waits.notify_ended`)."""
    notify_ended(conn, [task_id for task_id, status in moved if status == "FAILED"])
    return moved


def waiting_without_consumer(conn: Connection, priorities: Sequence[str]) -> dict[str, int]:
    """Per priority among ``priorities``: tasks DISPATCHING or due READY (what waits for a worker);
    Celery-bound tasks are left out (Celery workers consume them, not ax's queues)."""
    if not priorities:
        return {}
    found: dict[str, int] = {}
    for status in ("DISPATCHING", "READY"):  # one index each (ax_kombu.store.schema)
        stmt = text(f"SELECT priority, count(*) FROM ax_task WHERE status = '{status}' "
                    f"AND priority IN :priorities AND NOT {off_ax_queues()} GROUP BY priority"
                    ).bindparams(bindparam("priorities", expanding=True))
        for priority, n in conn.execute(stmt, {"priorities": list(priorities)}):
            found[priority] = found.get(priority, 0) + int(n)
    return found


#: a RUNNING row whose run never started: its worker had listed it
#: (ax_node.listed_runs, a run listed there does not start before a write without it:
#: :mod:`ax_kombu.worker.listing`). Anything else counts as started.
UNSTARTED = ("EXISTS (SELECT 1 FROM ax_node m WHERE m.node_id = ax_task.owner_node "
             "AND m.listed_runs LIKE '%,' || CAST(ax_task.task_id AS TEXT) || ',%')")

#: a run that started and whose worker died counts a retry (FAILED when none is left); one
#: that never started (staged, listed) gets a new attempt with no retry counted
_RECOVER_RUNNING = f"""
UPDATE ax_task
   SET status = CASE WHEN retry_count < max_retry OR {UNSTARTED} THEN 'DELAYED'
                     ELSE 'FAILED' END,
       retry_count = CASE WHEN {UNSTARTED} THEN retry_count
                          WHEN retry_count < max_retry THEN retry_count + 1
                          ELSE retry_count END,
       -- a run staged before its trigger time and recovered before it: never earlier
       trigger_time = CASE WHEN (retry_count < max_retry OR {UNSTARTED}) AND trigger_time < :now
                           THEN :now ELSE trigger_time END,
       finished_at = CASE WHEN retry_count < max_retry OR {UNSTARTED} THEN NULL ELSE :now END,
       last_error = CASE WHEN {UNSTARTED} THEN :unstarted_error ELSE :error END,
       owner_node = NULL
 WHERE {{where}}
RETURNING task_id, status
"""

UNSTARTED_ERROR = "worker lost before the run started (it was staged)"

_NOT_ALIVE = ("owner_node NOT IN (SELECT node_id FROM ax_node WHERE stopped_at IS NULL "
              "AND heartbeat_at >= :alive)")


def recover_running(conn: Connection, nodes: Sequence[str], now_ms: int,
                    keep: Sequence[int] = ()) -> list[tuple[int, str]]:
    """RUNNING tasks of dead workers: retried now if retries remain, else FAILED.

    ``keep``: task ids left alone (still running in the calling process).
    Returns ``(task_id, new_status)`` pairs.
    """
    if not nodes:
        return []
    which = "owner_node IN :nodes"
    if keep:
        which += " AND task_id NOT IN :keep"
    params: dict[str, Any] = {"nodes": list(nodes), "now": now_ms, "error": "worker lost",
                              "unstarted_error": UNSTARTED_ERROR}
    if keep:
        params["keep"] = list(keep)
    return _move_lockable(conn, "RUNNING", which, params,
                          ("nodes", "keep") if keep else ("nodes",), _RECOVER_RUNNING,
                          partial(_record_lost, conn))


def _record_lost(conn: Connection, where: str, params: dict[str, Any], *expanding: str) -> None:
    """The history of a dead worker's RUNNING rows: "worker lost", or, for a run it had
    listed (staged, never started), why it gets another attempt."""
    _record_ended(conn, where, params, "LOST", "worker lost", *expanding,
                  why_sql=f"CASE WHEN {UNSTARTED} THEN :unstarted_error ELSE :ended_why END")


def recover_orphan_running(conn: Connection, now_ms: int,
                           alive_after_ms: int) -> list[tuple[int, str]]:
    """RUNNING tasks whose worker is not alive, whatever the reason (killed, or stopped
    while the database was down so it could not record the results): retried or FAILED.

    A worker that is slow but heartbeating keeps its tasks: this never looks at age.
    """
    params = {"now": now_ms, "error": "worker lost", "alive": alive_after_ms,
              "unstarted_error": UNSTARTED_ERROR}
    return _move_lockable(conn, "RUNNING", _NOT_ALIVE, params, (), _RECOVER_RUNNING,
                          partial(_record_lost, conn))


#: ids per statement when the rows to move were locked first (a bound list)
MOVE_CHUNK = 1000


def _move_lockable(conn: Connection, status: str, which: str, params: dict[str, Any],
                   expanding: Sequence[str], move_sql: str,
                   record: Callable[..., None],
                   ) -> list[tuple[int, str]]:
    """Move the rows in ``status`` that ``which`` selects with ``move_sql`` (an UPDATE …
    WHERE {where} RETURNING task_id, status), their ended attempts recorded first by
    ``record(where, params, *expanding)``; the FAILED ones announced. On PostgreSQL only the
    rows no other transaction holds (see the module docstring): they are locked first, then
    moved by id, their status checked again."""
    guard = f"status = '{status}'"
    where = f"{guard} AND {which}"
    if conn.dialect.name != "postgresql":
        record(where, params, *expanding)
        stmt = text(move_sql.format(where=where)).bindparams(
            *[bindparam(name, expanding=True) for name in expanding])
        return _announced(conn, [(r[0], r[1]) for r in conn.execute(stmt, params)])
    lock = text(f"SELECT task_id FROM ax_task WHERE {where} FOR UPDATE SKIP LOCKED").bindparams(
        *[bindparam(name, expanding=True) for name in expanding])
    ids = [int(r[0]) for r in conn.execute(lock, params)]
    moved: list[tuple[int, str]] = []
    by_id = f"{guard} AND task_id IN :ids"
    stmt = text(move_sql.format(where=by_id)).bindparams(bindparam("ids", expanding=True))
    for at in range(0, len(ids), MOVE_CHUNK):
        chunk = {**params, "ids": ids[at:at + MOVE_CHUNK]}
        record(by_id, chunk, "ids")
        moved += [(r[0], r[1]) for r in conn.execute(stmt, chunk)]
    return _announced(conn, moved)


_OLDEST_DUE = """
SELECT min(t) FROM (
  SELECT (SELECT trigger_time FROM ax_task WHERE status = 'CREATED' AND trigger_time <= :now
           ORDER BY trigger_time LIMIT 1) AS t
  UNION ALL
  SELECT (SELECT trigger_time FROM ax_task WHERE status = 'DELAYED' AND trigger_time <= :now
           ORDER BY trigger_time LIMIT 1)
  UNION ALL
  SELECT (SELECT trigger_time FROM ax_task WHERE status = 'READY' AND trigger_time <= :now
           AND """ + UNPARKED + """
           ORDER BY trigger_time LIMIT 1)
  UNION ALL
  SELECT (SELECT trigger_time FROM ax_task WHERE status = 'DISPATCHING' AND trigger_time <= :now
           ORDER BY trigger_time LIMIT 1)) AS due"""


def oldest_overdue_ms(conn: Connection, now_ms: int) -> int:
    """How long the oldest due task not yet started has waited (0: none): CREATED, DELAYED,
    READY, or DISPATCHING (published and waiting in the broker); tasks parked for their
    order key or limit wait by design and are left out. Three index probes on
    ``(status, trigger_time)``; on PostgreSQL the DISPATCHING one reads the in-flight
    index whole (:mod:`ax_kombu.store.schema`)."""
    oldest = conn.execute(text(_OLDEST_DUE), {"now": now_ms}).scalar()
    return max(0, now_ms - int(oldest)) if oldest is not None else 0
