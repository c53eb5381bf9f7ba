"""The scheduler's reads of the task table: the preload window and the recovery scans.

Ownership: a DELAYED or READY row whose ``last_run_node`` names a scheduler
is *held* by that scheduler (it is in that node's memory and that node will
claim it when due). ``last_run_node IS NULL`` means nobody holds it, and the
next preload of any scheduler adopts it. The preload takes CREATED rows and
unheld rows in one index range each (``(status, trigger_time)``), bounded by
the window and a row limit, never the whole table. On PostgreSQL the
candidate rows are locked ``SKIP LOCKED``, so schedulers preloading at the
same moment take disjoint sets; SQLite serialises writers, which gives the
same. Every statement here is a compare-and-set: it re-checks the state it
moves from.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, bindparam, text

from ax_kombu.store.claims import celery_bound, fire_time

# PostgreSQL: the candidates are locked in a MATERIALIZED CTE, evaluated once, and joined
# back by primary key only (rows it locked cannot change state meanwhile, so no recheck).
# Written as ``WHERE task_id IN (subquery) AND status = …`` the planner, with stale
# statistics on a young table, re-ran the locking subquery (or a join filter) for every
# outer row: 3.6 s instead of a few ms for 4,000 rows.
_PRELOAD_CREATED = {
    "postgresql": """
WITH c AS MATERIALIZED (SELECT task_id FROM ax_task
                         WHERE status = 'CREATED' AND trigger_time < :horizon
                         ORDER BY trigger_time LIMIT :n FOR UPDATE SKIP LOCKED)
UPDATE ax_task AS t
   SET status = CASE WHEN t.trigger_time <= :now THEN 'READY' ELSE 'DELAYED' END,
       last_run_node = :node
  FROM c WHERE t.task_id = c.task_id
RETURNING t.task_id, """ + fire_time("t.trigger_time", "t.runner"),
    "sqlite": """
UPDATE ax_task
   SET status = CASE WHEN trigger_time <= :now THEN 'READY' ELSE 'DELAYED' END,
       last_run_node = :node
 WHERE task_id IN (SELECT task_id FROM ax_task
                    WHERE status = 'CREATED' AND trigger_time < :horizon
                    ORDER BY trigger_time LIMIT :n)
   AND status = 'CREATED'
RETURNING task_id, """ + fire_time(),
}

_ADOPT_UNHELD = {
    "postgresql": """
WITH c AS MATERIALIZED (SELECT task_id FROM ax_task
                         WHERE status IN ('DELAYED', 'READY') AND last_run_node IS NULL
                           AND trigger_time < :horizon
                         ORDER BY trigger_time LIMIT :n FOR UPDATE SKIP LOCKED)
UPDATE ax_task AS t SET last_run_node = :node
  FROM c WHERE t.task_id = c.task_id
RETURNING t.task_id, """ + fire_time("t.trigger_time", "t.runner"),
    "sqlite": """
UPDATE ax_task SET last_run_node = :node
 WHERE task_id IN (SELECT task_id FROM ax_task
                    WHERE status IN ('DELAYED', 'READY') AND last_run_node IS NULL
                      AND trigger_time < :horizon
                    ORDER BY trigger_time LIMIT :n)
   AND status IN ('DELAYED', 'READY') AND last_run_node IS NULL
RETURNING task_id, """ + fire_time(),
}


# Every preload walks the (status, trigger_time) range of CREATED rows below the horizon,
# where each task it ever moved on left a dead index entry (2,000 a second under a steady
# load) until VACUUM. A plain index scan marks such entries dead as it passes them, so the
# next preload skips them for free; a bitmap scan, which the planner picks on a young
# table's small estimates, never does and visits them all again each time: 7–15 ms per
# preload after 30 s at 2,000 tasks/s instead of about 1 ms. So, for this transaction only:
_INDEX_SCAN_ONLY = "SET LOCAL enable_bitmapscan = off"


def _sql(conn: Connection, forms: dict[str, str]) -> str:
    return forms["postgresql" if conn.dialect.name == "postgresql" else "sqlite"]


def preload(conn: Connection, node: str, now_ms: int, horizon_ms: int,
            limit: int, celery_lag_ms: int = 0) -> list[tuple[int, int]]:
    """Take up to ``limit`` tasks due before ``horizon_ms`` for ``node``, oldest first.

    CREATED rows become DELAYED (or READY when already due); unheld
    DELAYED/READY rows are adopted. Returns ``(task_id, trigger_time)`` pairs, a
    Celery-bound task's time ``celery_lag_ms`` later
    (:func:`ax_kombu.store.claims.fire_time`: the scheduler passes ``claim_lead_ms``,
    so such a task fires at its trigger time, unstaged). On PostgreSQL, ``conn``
    must be in a transaction (a planner setting is made for it alone).
    """
    params = {"node": node, "now": now_ms, "horizon": horizon_ms, "n": limit,
              "celery_lag": celery_lag_ms}
    if conn.dialect.name == "postgresql":
        conn.execute(text(_INDEX_SCAN_ONLY))
    rows = [(r[0], r[1]) for r in conn.execute(text(_sql(conn, _PRELOAD_CREATED)), params)]
    if len(rows) < limit:
        params["n"] = limit - len(rows)
        rows += [(r[0], r[1]) for r in conn.execute(text(_sql(conn, _ADOPT_UNHELD)), params)]
    return rows


def release_held(conn: Connection, nodes: Sequence[str]) -> int:
    """Let go of every DELAYED/READY task the given nodes hold; returns how many."""
    if not nodes:
        return 0
    stmt = text("UPDATE ax_task SET last_run_node = NULL WHERE status IN ('DELAYED', 'READY') "
                "AND last_run_node IN :nodes").bindparams(bindparam("nodes", expanding=True))
    return int(conn.execute(stmt, {"nodes": list(nodes)}).rowcount)


#: the ack timeout doubles with each re-dispatch of a task, up to 2**MAX_BACKOFF_STEPS times
MAX_BACKOFF_STEPS = 5

_UNACKED_AGE = (f"dispatched_at + (:ack_ms * (CASE WHEN redispatches > {MAX_BACKOFF_STEPS} "
                f"THEN {1 << MAX_BACKOFF_STEPS} ELSE (1 << redispatches) END)) < :now")
# Celery-bound tasks (runner 'celery' or 'celery_ax', see ax_kombu.store.schema) are
# consumed by Celery workers, which no ax heartbeat lists: they are looked at whatever the
# priorities. Each leaves DISPATCHING as soon as its publish is confirmed (store.handoff), or
# ('celery_ax') when the AxBootstep of a Celery worker starts it, so one still DISPATCHING
# after the ack timeout was never certainly published, or never started.
_UNACKED_WHERE = (f"status = 'DISPATCHING' AND {_UNACKED_AGE} AND (priority IN :priorities "
                  f"OR {celery_bound()})")
# The attempt a recovery ends goes to the history first, from the row as it still is; on
# PostgreSQL the rows are locked as they are read, so a worker's late result waits and then
# finds the row moved (its own history row then loses to this one: ON CONFLICT DO NOTHING).
_RECORD_ENDED = """
INSERT INTO ax_attempt (task_id, attempt, task_type, node, trigger_time, dispatched_at,
                        started_at, finished_at, outcome, error, duration_ms)
SELECT task_id, attempt, task_type, last_run_node, trigger_time, dispatched_at, started_at,
       :now, :outcome, :ended_why, :now - started_at
  FROM ax_task WHERE {where}{lock}
    ON CONFLICT (task_id, attempt) DO NOTHING"""


def _record_ended(conn: Connection, where: str, params: dict[str, Any], outcome: str,
                  why: str, *expanding: str) -> None:
    """Record in the history the attempts of the rows ``where`` selects, as ``outcome``."""
    lock = " FOR UPDATE" if conn.dialect.name == "postgresql" else ""
    stmt = text(_RECORD_ENDED.format(where=where, lock=lock)).bindparams(
        *[bindparam(name, expanding=True) for name in expanding])
    conn.execute(stmt, {**params, "outcome": outcome, "ended_why": why})


_REQUEUE_UNACKED = f"""
UPDATE ax_task
   SET status = CASE WHEN redispatches + 1 < :max_dispatches THEN 'READY' ELSE 'FAILED' END,
       redispatches = redispatches + 1,
       finished_at = CASE WHEN redispatches + 1 < :max_dispatches THEN NULL ELSE :now END,
       last_error = CASE WHEN redispatches + 1 < :max_dispatches THEN last_error
                         ELSE :gave_up END,
       last_run_node = NULL
 WHERE {_UNACKED_WHERE}
RETURNING task_id, status"""


def redispatch_unacked(conn: Connection, now_ms: int, ack_timeout_ms: int,
                    priorities: Sequence[str], max_dispatches: int) -> list[tuple[int, str]]:
    """DISPATCHING tasks no worker started in time → READY (unheld), or FAILED past the limit.

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
    stmt = text(_REQUEUE_UNACKED).bindparams(bindparam("priorities", expanding=True))
    gave_up = (f"dispatched {max_dispatches} times and never started by a worker "
               f"(ack timeout {ack_timeout_ms} ms, doubling per dispatch); see AX_MAX_DISPATCHES")
    # no priority is named "": an empty list would render as an untyped empty IN
    params = {"now": now_ms, "ack_ms": ack_timeout_ms, "priorities": list(priorities) or [""],
              "max_dispatches": max_dispatches, "gave_up": gave_up}
    _record_ended(conn, _UNACKED_WHERE, params, "UNACKED",
                  f"not started by a worker within the ack timeout ({ack_timeout_ms} ms, "
                  "doubling per dispatch)", "priorities")
    return [(r[0], r[1]) for r in conn.execute(stmt, params)]


def waiting_without_consumer(conn: Connection, priorities: Sequence[str]) -> dict[str, int]:
    """Per priority among ``priorities``: tasks DISPATCHING or due READY (what waits for a worker);
    Celery-bound tasks are left out (Celery workers consume them, not ax's queues)."""
    if not priorities:
        return {}
    stmt = text("SELECT priority, count(*) FROM ax_task WHERE status IN ('DISPATCHING', 'READY') "
                f"AND priority IN :priorities AND NOT {celery_bound()} GROUP BY priority"
                ).bindparams(bindparam("priorities", expanding=True))
    return {r[0]: int(r[1]) for r in conn.execute(stmt, {"priorities": list(priorities)})}


_RECOVER_RUNNING = """
UPDATE ax_task
   SET status = CASE WHEN retry_count < max_retry THEN 'DELAYED' ELSE 'FAILED' END,
       retry_count = CASE WHEN retry_count < max_retry THEN retry_count + 1 ELSE retry_count END,
       -- a run staged before its trigger time and recovered before it: never earlier
       trigger_time = CASE WHEN retry_count < max_retry AND trigger_time < :now THEN :now
                           ELSE trigger_time END,
       finished_at = CASE WHEN retry_count < max_retry THEN NULL ELSE :now END,
       last_error = :error, last_run_node = NULL
 WHERE status = 'RUNNING' AND {which}
RETURNING task_id, status
"""

_NOT_ALIVE = ("last_run_node NOT IN (SELECT node_id FROM ax_node WHERE stopped_at IS NULL "
              "AND heartbeat_at >= :alive)")


def recover_running(conn: Connection, nodes: Sequence[str], now_ms: int,
                    keep: Sequence[int] = ()) -> list[tuple[int, str]]:
    """RUNNING tasks of dead workers: retried now if retries remain, else FAILED.

    ``keep``: task ids left alone (still running in the calling process).
    Returns ``(task_id, new_status)`` pairs.
    """
    if not nodes:
        return []
    which = "last_run_node IN :nodes"
    if keep:
        which += " AND task_id NOT IN :keep"
    stmt = text(_RECOVER_RUNNING.format(which=which)).bindparams(
        bindparam("nodes", expanding=True), *([bindparam("keep", expanding=True)] if keep else []))
    params: dict[str, Any] = {"nodes": list(nodes), "now": now_ms, "error": "worker lost"}
    if keep:
        params["keep"] = list(keep)
    _record_ended(conn, f"status = 'RUNNING' AND {which}", params, "LOST", "worker lost",
                  *(["nodes", "keep"] if keep else ["nodes"]))
    return [(r[0], r[1]) for r in conn.execute(stmt, params)]


def recover_orphan_running(conn: Connection, now_ms: int,
                           alive_after_ms: int) -> list[tuple[int, str]]:
    """RUNNING tasks whose worker is not alive, whatever the reason (killed, or stopped
    while the database was down so it could not record the results): retried or FAILED.

    A worker that is slow but heartbeating keeps its tasks: this never looks at age.
    """
    stmt = text(_RECOVER_RUNNING.format(which=_NOT_ALIVE))
    params = {"now": now_ms, "error": "worker lost", "alive": alive_after_ms}
    _record_ended(conn, f"status = 'RUNNING' AND {_NOT_ALIVE}", params, "LOST", "worker lost")
    return [(r[0], r[1]) for r in conn.execute(stmt, params)]


def release_orphans(conn: Connection, due_before_ms: int, alive_after_ms: int) -> int:
    """Let go of due DELAYED/READY tasks held by a node that is not alive; returns how many.

    Catches what the dead-node path cannot: a holder whose node row is gone
    or was stopped without releasing its tasks. Parked tasks (waiting for their order key
    or limit, :mod:`ax_kombu.store.gates`) are not orphans: ``wake_stranded`` looks after them.
    """
    stmt = text("""
        UPDATE ax_task SET last_run_node = NULL
         WHERE status IN ('DELAYED', 'READY') AND trigger_time < :due_before
           AND last_run_node IS NOT NULL AND last_run_node <> '~parked'
           AND last_run_node NOT IN (SELECT node_id FROM ax_node
                                      WHERE stopped_at IS NULL AND heartbeat_at >= :alive)""")
    return int(conn.execute(stmt, {"due_before": due_before_ms,
                                   "alive": alive_after_ms}).rowcount)


_OLDEST_DUE = """
SELECT min(t) FROM (
  SELECT (SELECT trigger_time FROM ax_task WHERE status = 'CREATED' AND trigger_time <= :now
           ORDER BY trigger_time LIMIT 1) AS t
  UNION ALL
  SELECT (SELECT trigger_time FROM ax_task WHERE status = 'DELAYED' AND trigger_time <= :now
           ORDER BY trigger_time LIMIT 1)
  UNION ALL
  SELECT (SELECT trigger_time FROM ax_task WHERE status = 'READY' AND trigger_time <= :now
           AND (last_run_node IS NULL OR last_run_node <> '~parked')
           ORDER BY trigger_time LIMIT 1)
  UNION ALL
  SELECT (SELECT trigger_time FROM ax_task WHERE status = 'DISPATCHING' AND trigger_time <= :now
           ORDER BY trigger_time LIMIT 1)) AS due"""


def oldest_overdue_ms(conn: Connection, now_ms: int) -> int:
    """How long the oldest due task not yet started has waited (0: none): CREATED, DELAYED,
    READY, or DISPATCHING (published and waiting in the broker); tasks parked for their
    order key or limit wait by design and are left out. Four index probes on
    ``(status, trigger_time)``."""
    oldest = conn.execute(text(_OLDEST_DUE), {"now": now_ms}).scalar()
    return max(0, now_ms - int(oldest)) if oldest is not None else 0


def held_by(conn: Connection, node: str, horizon_ms: int, limit: int, *,
            celery_lag_ms: int = 0) -> list[tuple[int, int]]:
    """DELAYED/READY tasks ``node`` holds, due before ``horizon_ms``: ``(task_id, trigger_time)``,
    a Celery-bound task's time ``celery_lag_ms`` later (as for :func:`preload`).

    A preload whose commit reply was lost left rows held by the node that its
    memory does not have; the node reconciles with this after such an error.
    """
    stmt = text(f"SELECT task_id, {fire_time()} FROM ax_task "
                "WHERE status IN ('DELAYED', 'READY') "
                "AND last_run_node = :node AND trigger_time < :horizon "
                "ORDER BY trigger_time LIMIT :n")
    return [(r[0], r[1]) for r in conn.execute(stmt, {"node": node, "horizon": horizon_ms,
                                                      "n": limit, "celery_lag": celery_lag_ms})]
