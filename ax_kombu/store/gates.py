"""The gated claim, and waking what it parked: order keys, limits, job strategies in SQL.

The ordinary claim (:mod:`ax_kombu.store.claims`) leaves gated tasks alone — those with a
``gate`` or of a type that has a limit in ``ax_limit``. The scheduler sends the ones it
fired to :func:`claim_gated`, which in one transaction:

1. locks their order keys, task types and jobs (PostgreSQL transaction advisory locks, in
   sorted order; SQLite's one writer is lock enough),
2. reads what is running, the head of each key and each limit
   (:class:`ax_kombu.core.gating.Running`), and lets :func:`ax_kombu.core.gating.decide`
   choose,
3. claims the tasks that may start (the ordinary claim statement, plus ``gated = true``),
   cancels discarded and superseded occurrences (compare-and-set, with the reason), and
   **parks** the tasks that must wait: READY with ``parked`` set (``owner_node`` NULL), so no
   preload takes them again and again.

When a gated run ends, the worker that wrote its result calls :func:`wake_next` in the
same transaction, under the same locks: the head of its key and as many tasks of its type
as runs ended are un-parked (``parked`` false) and the schedulers woken
(``NOTIFY``); the next preload claims them. The locks make "park" and "wake" serial per
key and type, so no task is parked just after the wake meant for it. As a backstop for a
wake that never comes (the worker died running the task), the scheduler's recovery calls
:func:`wake_stranded` after it recovers a dead node's tasks and at every recovery scan.

Guarantees: never more than the limit of a type DISPATCHING or RUNNING at once (counted
under the type's lock); never two tasks of one key at once, and a key's tasks start in
``(order_seq, task_id)`` order.

Every end outside a worker's result wakes what waits as a worker's does: a claimed task
whose message cannot be built (:mod:`ax_kombu.broker.celery_wire`) ends FAILED alone,
with the reason (:func:`fail_unbuildable`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any, NamedTuple

from sqlalchemy import Connection, Row, bindparam, delete, insert, select, text
from sqlalchemy.dialects import postgresql, sqlite

from ax_kombu.core.fingerprint import fingerprint
from ax_kombu.core.gating import Candidate, Decision, Running, decide
from ax_kombu.core.states import Status
from ax_kombu.store import transitions
from ax_kombu.store.claims import claim
from ax_kombu.store.schema import CLAIMABLE, UNPARKED, limits, tasks
from ax_kombu.store.tasks import wake_schedulers
from ax_kombu.store.transitions import execute_batch, storable
from ax_kombu.store.waits import notify_ended

_WAITING = ("CREATED", "DELAYED", "READY")
_ACTIVE = ("DISPATCHING", "RUNNING")
_LOCK_BASE = 0x6178_4700_0000  # "axG": apart from tasks.py's advisory locks


def _expanding(sql: str, *names: str) -> Any:
    return text(sql).bindparams(*[bindparam(n, expanding=True) for n in names])


_CANDIDATES = _expanding(
    "SELECT task_id, task_type, trigger_time, gate, order_key, job, scheduled_at FROM ax_task "
    f"WHERE task_id IN :ids AND {CLAIMABLE} AND {UNPARKED} AND trigger_time <= :due", "ids")
_LIMITS = _expanding("SELECT task_type, max_running FROM ax_limit WHERE task_type IN :types",
                     "types")
_ACTIVE_BY_TYPE = _expanding(
    "SELECT task_type, count(*) FROM ax_task WHERE task_type IN :types "
    "AND status IN ('DISPATCHING', 'RUNNING') GROUP BY task_type", "types")
_BUSY_KEYS = _expanding(
    "SELECT DISTINCT order_key FROM ax_task WHERE order_key IN :keys "
    "AND status IN ('DISPATCHING', 'RUNNING')", "keys")
# the first waiting task of each key; under skip_failed a retry not yet due gives up its
# place (the key goes on without it) and takes it back when due
_HEADS = _expanding(
    "SELECT order_key, task_id FROM (SELECT order_key, task_id, ROW_NUMBER() OVER "
    "(PARTITION BY order_key ORDER BY order_seq, task_id) AS n FROM ax_task "
    "WHERE order_key IN :keys AND status IN ('CREATED', 'DELAYED', 'READY') "
    "AND NOT (gate = 'order_skip' AND retry_count > 0 AND trigger_time > :due)) AS w "
    "WHERE n = 1", "keys")
_UNFINISHED = _expanding(
    "SELECT job, task_id, scheduled_at FROM ax_task WHERE job IN :jobs "
    "AND status IN ('CREATED', 'DELAYED', 'READY', 'DISPATCHING', 'RUNNING')", "jobs")
_PARK = _expanding(
    "UPDATE ax_task SET status = 'READY', parked = true, owner_node = NULL "
    f"WHERE task_id IN :ids AND {CLAIMABLE} AND {UNPARKED}", "ids")
_WAKE_KEY = text(
    "UPDATE ax_task SET parked = false WHERE task_id IN (SELECT task_id FROM ax_task "
    "WHERE order_key = :key AND parked AND status = 'READY' "
    "ORDER BY order_seq, task_id LIMIT 1)")
_WAKE_TYPE = text(
    "UPDATE ax_task SET parked = false WHERE task_id IN (SELECT task_id FROM ax_task "
    "WHERE task_type = :type AND parked AND status = 'READY' "
    "AND EXISTS (SELECT 1 FROM ax_limit AS l WHERE l.task_type = :type) "
    "ORDER BY trigger_time, task_id LIMIT :n)")
_WAKE_ALL_OF_TYPE = text(
    "UPDATE ax_task SET parked = false WHERE task_type = :type "
    "AND parked AND status = 'READY'")


def lock(conn: Connection, kinds: Iterable[tuple[str, str]]) -> None:
    """Take the transaction-scoped locks of ``(kind, name)`` pairs (PostgreSQL), sorted."""
    if conn.dialect.name != "postgresql":
        return
    keys = sorted({_LOCK_BASE + int.from_bytes(hashlib.blake2b(
        f"{kind}\0{name}".encode(), digest_size=6).digest(), "big") for kind, name in kinds})
    if keys:
        conn.execute(text("SELECT count(pg_advisory_xact_lock(k)) FROM "
                          "unnest(CAST(:keys AS BIGINT[])) AS k"), {"keys": keys})


class Broadcast(NamedTuple):
    """What the gated claim needs to expand a ``shards="workers"`` task."""

    #: ``workers(conn, priority)``: the live workers consuming that priority's queue
    workers: Callable[[Connection, str], list[str]]
    #: ``new_ids(n)``: n fresh task ids
    new_ids: Callable[[int], list[int]]


def claim_gated(conn: Connection, task_ids: Sequence[int], node: str, now_ms: int,
                due_before: int, broadcast: Broadcast | None = None
                ) -> tuple[list[Row[Any]], Decision]:
    """Claim what may start of ``task_ids`` (gated tasks this node fired), park what must
    wait, cancel what its job's strategy drops, expand a ``shards="workers"`` task into one
    shard per live worker (``broadcast``; without it, or without a live worker, such a
    task stays unclaimed). Call inside a transaction.

    Returns:
        The claimed rows (as :func:`ax_kombu.store.claims.claim` returns them) and the
        decision taken.
    """
    found = [Candidate(*r) for r in conn.execute(
        _CANDIDATES, {"ids": list(task_ids), "due": due_before})]
    if not found:
        return [], Decision()
    keys = {c.order_key for c in found if c.order_key is not None}
    types = {c.task_type for c in found}
    jobs = {c.job for c in found if c.job is not None and c.gate in ("discard", "cover")}
    lock(conn, [("k", k) for k in keys] + [("t", t) for t in types] + [("j", j) for j in jobs])
    decision = decide(found, _running(conn, keys, types, jobs, due_before))
    for task_id, reason in decision.cancel + decision.supersede:
        transitions.transition(conn, [task_id], [Status(s) for s in _WAITING + _ACTIVE],
                               Status.CANCELLED,
                               values={"finished_at": now_ms, "last_error": reason})
    start = list(decision.start)
    for c in found:
        if c.gate == "workers" and c.task_id in start:
            start.remove(c.task_id)
            start += _expand(conn, c.task_id, node, now_ms, broadcast)
    rows = claim(conn, start, node, now_ms, due_before, gated=True)
    if decision.wait:
        conn.execute(_PARK, {"ids": decision.wait})
    return rows, decision


_BROADCAST_ROW = text("SELECT * FROM ax_task WHERE task_id = :id")
_SHARD_ZERO = text("UPDATE ax_task SET gate = NULL, shard_index = 0, shard_total = :n, "
                   "target_node = :target WHERE task_id = :id")


def _expand(conn: Connection, task_id: int, node: str, now_ms: int,
            broadcast: Broadcast | None) -> list[int]:
    """One shard per live worker of the task's queue: the task becomes shard 0 (for the
    first worker), copies of it the others, claimed by ``node`` next; returns their ids
    (none: no live worker yet, the task waits)."""
    if broadcast is None:
        return []
    (row,) = conn.execute(_BROADCAST_ROW, {"id": task_id}).mappings().all()
    workers = broadcast.workers(conn, row["priority"])
    if not workers:
        return []
    conn.execute(_SHARD_ZERO, {"n": len(workers), "target": workers[0], "id": task_id})
    copies = [dict(row, task_id=new_id, gate=None, shard_index=i, shard_total=len(workers),
                   target_node=worker, biz_key=None, created_at=now_ms,
                   fingerprint=fingerprint(f"{row['task_type']}\0shard{i}/{len(workers)}",
                                           f"{row['fingerprint']}"))
              for i, (new_id, worker) in enumerate(
                  zip(broadcast.new_ids(len(workers) - 1), workers[1:], strict=True), start=1)]
    if copies:
        conn.execute(insert(tasks), copies)
    return [task_id, *[c["task_id"] for c in copies]]


def _running(conn: Connection, keys: Collection[str], types: Collection[str],
             jobs: Collection[str], due_before: int) -> Running:
    limits = dict(conn.execute(_LIMITS, {"types": list(types)}).all()) if types else {}
    active = (dict(conn.execute(_ACTIVE_BY_TYPE, {"types": list(limits)}).all())
              if limits else {})
    busy: frozenset[str] = frozenset()
    heads: dict[str, int] = {}
    if keys:
        busy = frozenset(r[0] for r in conn.execute(_BUSY_KEYS, {"keys": list(keys)}))
        heads = dict(conn.execute(_HEADS, {"keys": list(keys), "due": due_before}).all())
    unfinished: dict[str, list[tuple[int, int]]] = {}
    if jobs:
        for job, task_id, scheduled_at in conn.execute(_UNFINISHED, {"jobs": list(jobs)}):
            unfinished.setdefault(job, []).append((task_id, scheduled_at or 0))
    return Running(limits, active, busy, heads, unfinished)


def wake_next(conn: Connection, ended: Sequence[tuple[str, str | None]]) -> int:
    """Gated runs ended — ``(task_type, order_key)`` each: un-park the next of each key and
    one task of the type per run ended, and wake the schedulers. Call inside the
    transaction that records the ends. Returns how many were un-parked."""
    if not ended:
        return 0
    keys = sorted({k for _, k in ended if k is not None})
    per_type: dict[str, int] = {}
    for task_type, _ in ended:
        per_type[task_type] = per_type.get(task_type, 0) + 1
    lock(conn, [("k", k) for k in keys] + [("t", t) for t in per_type])
    woken = 0
    for key in keys:
        woken += conn.execute(_WAKE_KEY, {"key": key}).rowcount or 0
    for task_type, n in sorted(per_type.items()):
        woken += conn.execute(_WAKE_TYPE, {"type": task_type, "n": n}).rowcount or 0
    if woken:
        wake_schedulers(conn, 0)
    return woken


_STRANDED_KEYS = text(
    "SELECT DISTINCT p.task_type, p.order_key FROM ax_task AS p "
    "WHERE p.status = 'READY' AND p.parked AND p.order_key IS NOT NULL "
    "AND NOT EXISTS (SELECT 1 FROM ax_task AS a WHERE a.order_key = p.order_key "
    "AND a.status IN ('DISPATCHING', 'RUNNING')) LIMIT :n")
_STRANDED_TYPES = text(
    "SELECT l.task_type, l.max_running - (SELECT count(*) FROM ax_task AS a "
    "WHERE a.task_type = l.task_type AND a.status IN ('DISPATCHING', 'RUNNING')) "
    "FROM ax_limit AS l WHERE EXISTS (SELECT 1 FROM ax_task AS p WHERE p.task_type = "
    "l.task_type AND p.status = 'READY' AND p.parked)")
_UNLIMITED_PARKED = text(
    "UPDATE ax_task SET parked = false WHERE status = 'READY' "
    "AND parked AND order_key IS NULL AND NOT EXISTS "
    "(SELECT 1 FROM ax_limit AS l WHERE l.task_type = ax_task.task_type)")


def wake_stranded(conn: Connection, most: int = 1000) -> int:
    """The backstop for wakes that never came (a worker that died running a gated task, a
    task cancelled while running): un-park the head of every parked key with nothing in
    progress, as many of each limited type as it has room for, and parked tasks whose
    limit is gone. Returns how many were un-parked."""
    ended = [(t, k) for t, k in conn.execute(_STRANDED_KEYS, {"n": most})]
    keys = sorted({k for _, k in ended})
    lock(conn, [("k", k) for k in keys])
    woken = sum(conn.execute(_WAKE_KEY, {"key": k}).rowcount or 0 for k in keys)
    for task_type, room in conn.execute(_STRANDED_TYPES).all():
        if room > 0:
            lock(conn, [("t", task_type)])
            woken += conn.execute(_WAKE_TYPE, {"type": task_type, "n": room}).rowcount or 0
    woken += conn.execute(_UNLIMITED_PARKED).rowcount or 0
    if woken:
        wake_schedulers(conn, 0)
    return woken


_RETARGET = _expanding(
    "UPDATE ax_task SET status = 'READY', owner_node = NULL, target_node = NULL, "
    "last_error = 'worker ' || target_node || ' died before this shard started; sent to "
    "another worker' WHERE target_node IN :dead AND status = 'DISPATCHING' RETURNING task_id",
    "dead")


def retarget(conn: Connection, dead: Sequence[str]) -> list[int]:
    """Shards sent to workers now dead and not started: back to READY for any live worker
    of their queue (the reason in ``last_error``); returns their ids. Their messages left
    in the dead worker's queue carry an attempt that is no longer the row's."""
    if not dead:
        return []
    return [r.task_id for r in conn.execute(_RETARGET, {"dead": list(dead)})]


def wake_type(conn: Connection, task_type: str) -> int:
    """Un-park every task of ``task_type`` (its limit was raised or cleared)."""
    lock(conn, [("t", task_type)])
    woken = conn.execute(_WAKE_ALL_OF_TYPE, {"type": task_type}).rowcount or 0
    if woken:
        wake_schedulers(conn, 0)
    return woken


# -- limits --------------------------------------------------------------------------------------


def set_limit(conn: Connection, task_type: str, max_running: int | None, now_ms: int) -> None:
    """Set (or with None clear) the limit of ``task_type``; tasks parked by a lower limit
    are woken, and so is the next claim's view of it."""
    lock(conn, [("t", task_type)])
    if max_running is None:
        conn.execute(delete(limits).where(limits.c.task_type == task_type))
    else:
        stmt = (postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert)(
            limits).values(task_type=task_type, max_running=max_running, updated_at=now_ms)
        conn.execute(stmt.on_conflict_do_update(
            index_elements=["task_type"],
            set_={"max_running": max_running, "updated_at": now_ms}))
    wake_type(conn, task_type)


def parked_by_type(conn: Connection) -> dict[str, int]:
    """How many tasks of each type are parked (waiting for their order key or limit)."""
    rows = conn.execute(text("SELECT task_type, count(*) FROM ax_task WHERE status = 'READY' "
                             "AND parked GROUP BY task_type ORDER BY task_type"))
    return {r[0]: int(r[1]) for r in rows}


def list_limits(conn: Connection) -> dict[str, int]:
    """Every limit: task type → most DISPATCHING or RUNNING at once."""
    rows = conn.execute(select(limits.c.task_type, limits.c.max_running)
                        .order_by(limits.c.task_type))
    return {r[0]: r[1] for r in rows}


#: a message that cannot be built: its task ends FAILED, fenced by attempt and by the node
#: that claimed it (its end wakes what waits on its order key or limit, as any end does)
_FAIL_UNBUILDABLE = """
    UPDATE ax_task AS t SET status = 'FAILED', finished_at = :now, last_error = v.err
      FROM {source}
     WHERE t.task_id = v.id AND t.attempt = v.att AND COALESCE(t.status, '') = 'DISPATCHING'
       AND t.owner_node = :node
 RETURNING task_id, task_type, gated, order_key"""


class Unbuildable(NamedTuple):
    """One claimed attempt whose message could not be built, and why."""

    task_id: int
    attempt: int
    reason: str


def fail_unbuildable(conn: Connection, refused: Sequence[Unbuildable], node: str,
                     now_ms: int) -> list[int]:
    """DISPATCHING → FAILED for each attempt in ``refused`` that ``node`` still owns at
    that attempt, ``last_error`` = its reason, ``finished_at = now_ms``; one statement.

    Returns:
        The ids that moved (announced to waiters: :mod:`ax_kombu.store.waits`).
    """
    if not refused:
        return []
    rows = list(execute_batch(conn, ("id", "att", "err"), _FAIL_UNBUILDABLE,
                              [(u.task_id, u.attempt, storable(u.reason)) for u in refused],
                              now=now_ms, node=node))
    wake_next(conn, [(r.task_type, r.order_key) for r in rows if r.gated])
    notify_ended(conn, [r.task_id for r in rows])
    return [r.task_id for r in rows]
