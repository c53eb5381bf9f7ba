"""The scheduler's reads of the task table: the preload window and the recovery scans.

**The preload only reads.** A task is inserted DELAYED (READY when already due) and stays
so, unwritten, until a claim moves it (:mod:`ax_kombu.store.claims`): the claim's
compare-and-set is the one arbiter, so a row that two schedulers both have in memory is
still dispatched once per attempt. To keep that rare and memory bounded, each scheduler
reads only its **share**: the live schedulers, sorted by name, split the task ids between
them (:class:`Share`; every scheduler reads ``ax_node`` each round). When the set of live
schedulers changes, each one reads its new share's whole window again, so a scheduler that
stopped or died is covered once the others see it gone (at its ``stopped_at``, or after
its silence window). Until then, what falls due in a dead scheduler's share is found by
the others as soon as it is overdue (:func:`overdue_elsewhere`, a few index probes that
find nothing while every owner fires its share): a killed scheduler's tasks are late by
about two preload intervals, not by its silence window.

A preload round reads, for its share:

* **the band** — every claimable task with ``loaded_until ≤ trigger_time < horizon``
  (:func:`preload`), at most ``limit`` plus those tied with the last one, after which
  ``loaded_until`` moves up to the last trigger time read; and
* **the changes** — tasks below ``loaded_until`` that became claimable since the last
  round: a retry, a requeue, ``ax retry``, a woken parked task, a task enqueued due soon.
  The database stamps each ``ax_due`` entry with the transaction that wrote it
  (``armed``: migration 0016's default and triggers, whoever writes); a round notes what
  its snapshot could see (:class:`Mark`) and the next asks for what was armed by a
  transaction that snapshot could not (:func:`changed_since`). The mark is read before
  the rows, so a transaction committing in between is read twice, never missed.

**Where they are read.** A scheduler's first round, and the first after its share
changed (``Loaded()``: nothing read yet), reads the band from the beginning of time in
``ax_task`` itself: three ordered index ranges on ``(status, trigger_time)``, merged, so
only claimable rows come back, however many have run. Every later round reads
``ax_due`` (migration 0016): an entry per task made due at a time, written by the
database's triggers and never updated. Its entries stay together (tens of pages for the
10,000 tasks enqueued for one second), where the same tasks' rows in a large ``ax_task``
are scattered over as many pages as tasks, each fetched: the busy preload cost 1.5–2.6×
more at 10M rows than at 10k (docs/benchmarks.md, "Issue 24"). The invariant
(migration 0016): a claimable, unparked task has an entry at its current trigger time,
armed no earlier than the transaction that made it so.

An entry may be out of date — its task since claimed, cancelled, parked or moved to
another time. It is handed over all the same: the claim's compare-and-set checks the
status and the trigger time and refuses it, and one moved later is handed back at its
real time (:func:`~ax_kombu.store.claims.still_claimable`); the timing loop keeps the
earlier of two times for an id it holds, so an out-of-date later time never delays a
task. :func:`prune_due` deletes the entries whose time has passed and whose task has
moved on (never one whose task is still due then, however late). A row read twice is
harmless for the same reasons. Every other statement here is a compare-and-set: it
re-checks the state it moves from.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from sqlalchemy import Connection, bindparam, text

from ax_kombu.store.claims import celery_bound, fire_time
from ax_kombu.store.schema import CLAIMABLE, UNPARKED


class Share(NamedTuple):
    """Which task ids a scheduler preloads: those whose :func:`share_key` is ``part``
    modulo ``of`` (``of`` = 1: all)."""

    of: int = 1
    part: int = 0

    @classmethod
    def among(cls, live: Sequence[str], node: str) -> Share:
        """This node's share among the live scheduler names ``live`` (it counts itself
        even when its own row looks silent)."""
        names = sorted(set(live) | {node})
        return cls(len(names), names.index(node))

    def sql(self, others: bool = False) -> str:
        """SQL: `` AND`` the row is in this share (``others``: in none of it)."""
        if self.of <= 1:
            return " AND 1 = 0" if others else ""
        return f" AND {share_key()} % {self.of} {'<>' if others else '='} {self.part}"


def share_key(column: str = "task_id") -> str:
    """SQL: a number spreading snowflake ids evenly (their millisecond, node and sequence
    fields summed; :mod:`ax_kombu.core.ids`), whatever rate the producers ran at."""
    return (f"(({column} >> 22) + (({column} >> 12) & 1023) + ({column} & 4095))")


#: the whole of the task ids: a scheduler alone
ALL = Share()


class Mark(NamedTuple):
    """What a preload's reads could see: rows armed by a transaction at or after ``xmax``
    or among ``xip`` (in progress then) were not visible, or not certainly."""

    xmax: int
    xip: tuple[int, ...] = ()


class Loaded(NamedTuple):
    """How far a scheduler has read its share: every claimable row due before
    ``until`` as of ``mark`` (None, with ``until`` 0: nothing read yet)."""

    until: int = 0
    mark: Mark | None = None


_MARK = {
    "postgresql": "SELECT pg_snapshot_xmax(s)::text::bigint, "
                  "ARRAY(SELECT x::text::bigint FROM pg_snapshot_xip(s) AS x) "
                  "FROM pg_current_snapshot() AS s",
    # one writer at a time: the counter's next value is the first one not yet seen
    "sqlite": "SELECT n + 1, NULL FROM ax_armed",
}


def _band_one(status: str, share: str, alias: str) -> str:
    return (f"SELECT * FROM (SELECT task_id, trigger_time, {fire_time()} AS fire "
            f"FROM ax_task WHERE status = '{status}' AND trigger_time >= :lo "
            f"AND trigger_time < :hi AND {UNPARKED}{share} "
            f"ORDER BY trigger_time LIMIT :n) AS {alias}")


def _band(share: str) -> str:
    # three ordered ranges of (status, trigger_time), merged: an IN list would sort them all
    parts = " UNION ALL ".join(_band_one(s, share, a) for s, a in
                               (("CREATED", "c"), ("DELAYED", "d"), ("READY", "r")))
    return f"SELECT task_id, trigger_time, fire FROM ({parts}) AS b ORDER BY trigger_time LIMIT :n"


def _tied(share: str) -> str:
    return (f"SELECT task_id, trigger_time, {fire_time()} FROM ax_task WHERE {CLAIMABLE} "
            f"AND trigger_time = :at AND {UNPARKED}{share}")


#: a steady round's reads of ``ax_due``: the band, the rest of its last instant, the changes
_DUE_BAND = ("SELECT task_id, trigger_time, {fire} FROM ax_due WHERE trigger_time >= :lo "
             "AND trigger_time < :hi{share} ORDER BY trigger_time LIMIT :n")
_DUE_TIED = "SELECT task_id, trigger_time, {fire} FROM ax_due WHERE trigger_time = :at{share}"
# (what was armed since is taken first, through its index: read in trigger-time order, the
# entries of the past the prune has yet to delete would be walked to find it)
_DUE_CHANGED = ("WITH c AS MATERIALIZED (SELECT task_id, trigger_time, runner FROM ax_due "
                "WHERE {changed}) SELECT task_id, trigger_time, {fire} FROM c "
                "WHERE trigger_time < :lo{share} ORDER BY trigger_time LIMIT :n")


def changed_since(mark: Mark, dialect: str) -> str:
    """SQL: the row was armed by a transaction ``mark``'s snapshot did not see."""
    if dialect == "postgresql" and mark.xip:
        return "(armed >= :xmax OR armed = ANY(CAST(:xip AS BIGINT[])))"
    return "armed >= :xmax"


# The band walks the (status, trigger_time) ranges of claimable rows, where each task the
# claim moved on left a dead index entry (2,000 a second under a steady load) until
# VACUUM. A plain index scan marks such entries dead as it passes them, so the next
# preload skips them for free; a bitmap scan, which the planner picks on a young table's
# small estimates, never does and visits them all again each time: 7–15 ms per preload
# after 30 s at 2,000 tasks/s instead of about 1 ms. And on stale estimates the planner
# may read a whole index of the claimable rows and sort it (``ax_task``'s ``armed`` index,
# before migration 0018: 23 ms for 5,000 future rows, none in the band). So, for this
# transaction only, neither:
_INDEX_SCAN_ONLY = ("SELECT set_config('enable_bitmapscan', 'off', true), "
                    "set_config('enable_sort', 'off', true)")


def _dialect(conn: Connection) -> str:
    return "postgresql" if conn.dialect.name == "postgresql" else "sqlite"


def read_mark(conn: Connection) -> Mark:
    """What a read made now can see (read it *before* the rows: see the module docstring)."""
    xmax, xip = conn.execute(text(_MARK[_dialect(conn)])).one()
    return Mark(int(xmax), tuple(int(x) for x in xip or ()))


def preload(conn: Connection, loaded: Loaded, horizon_ms: int, limit: int,
            share: Share = ALL, celery_lag_ms: int = 0
            ) -> tuple[list[tuple[int, int]], Loaded]:
    """One preload round for ``share``: the band ``[loaded.until, horizon_ms)`` (at most
    ``limit`` tasks and those tied with the last) and, below it, what was armed since
    ``loaded.mark``; from ``ax_task`` when nothing is read yet (``Loaded()``), else from
    ``ax_due`` (see the module docstring). Writes nothing.

    Returns:
        ``(task_id, time)`` pairs for the timing loop — a Celery-bound task's time
        ``celery_lag_ms`` after its trigger time (:func:`ax_kombu.store.claims.fire_time`:
        the scheduler passes ``claim_lead_ms``, so such a task fires when due, unstaged)
        — and how far the share is now read. After the first round a pair may be out of
        date (the claim refuses it). On PostgreSQL, ``conn`` must be in a transaction
        (planner settings are made for it alone).
    """
    dialect = _dialect(conn)
    mark = read_mark(conn)
    where = share.sql()
    params: dict[str, Any] = {"lo": loaded.until, "hi": horizon_ms, "n": limit,
                              "celery_lag": celery_lag_ms}
    seen = loaded.mark if loaded.until > 0 else None  # None: nothing read yet
    fire = fire_time()
    band_sql, tied_sql = ((_band(where), _tied(where)) if seen is None else
                          (_DUE_BAND.format(fire=fire, share=where),
                           _DUE_TIED.format(fire=fire, share=where)))
    changed: list[Any] = []
    if seen is not None:  # first: it may need a bitmap scan
        params.update(xmax=seen.xmax, xip=list(seen.xip))
        changed = list(conn.execute(text(_DUE_CHANGED.format(
            fire=fire, share=where, changed=changed_since(seen, dialect))), params))
    if dialect == "postgresql":
        conn.execute(text(_INDEX_SCAN_ONLY))
    band = list(conn.execute(text(band_sql), params))
    until = max(horizon_ms, loaded.until)
    if len(band) >= limit:  # the rest of the last instant too, then go on after it
        last = band[-1][1]
        band = [r for r in band if r[1] < last]
        band += conn.execute(text(tied_sql), {**params, "at": last})
        until = last + 1
    if len(changed) >= limit:  # read again, as band, from the last one on
        until = min(until, changed[-1][1])
    rows = [(r[0], r[2]) for r in band] + [(r[0], r[2]) for r in changed]
    return rows, Loaded(until, mark)


#: an entry whose task is still due at its time, and not parked: never pruned
_STILL_DUE = (f"EXISTS (SELECT 1 FROM ax_task AS t WHERE t.task_id = d.task_id "
              f"AND t.trigger_time = d.trigger_time AND t.{CLAIMABLE} AND {UNPARKED})")
_PRUNE_DUE = {
    "postgresql": "DELETE FROM ax_due WHERE ctid = ANY(ARRAY(SELECT ctid FROM ax_due AS d "
                  "WHERE trigger_time < :before{share} AND NOT {still} LIMIT :limit))",
    "sqlite": "DELETE FROM ax_due WHERE rowid IN (SELECT rowid FROM ax_due AS d "
              "WHERE trigger_time < :before{share} AND NOT {still} LIMIT :limit)",
}


def prune_due(conn: Connection, before_ms: int, limit: int, share: Share = ALL) -> int:
    """Delete up to ``limit`` of ``share``'s ``ax_due`` entries with a time before
    ``before_ms`` whose task is no longer due then (claimed, ended, cancelled, parked,
    given another time, removed); returns how many. An entry whose task is still claimable
    at its time stays, however late, so no round that has yet to read it can miss it; one
    made stale by a transaction running meanwhile stays until the next prune. (One
    statement: what it chooses is what its own snapshot sees.)"""
    sql = _PRUNE_DUE[_dialect(conn)].format(share=share.sql(), still=_STILL_DUE)
    return int(conn.execute(text(sql), {"before": before_ms, "limit": limit}).rowcount)


def overdue_elsewhere(conn: Connection, before_ms: int, share: Share, limit: int,
                      celery_lag_ms: int = 0, since_ms: int = 0) -> list[tuple[int, int]]:
    """Claimable tasks of the *other* shares due before ``before_ms``: those of a
    scheduler killed or paused and not yet past its silence window (it still counts as
    live, so nobody else reads its share), of one that beats but cannot preload (its
    database calls fail while its heartbeat's do not), or of a share nobody read while
    the schedulers disagreed on who is alive. At most ``limit``, oldest first, as
    :func:`preload` returns them; none for a scheduler alone. ``since_ms``: only those
    due at or after it (the index ranges start there: parked tasks, READY in the same
    range, are walked only from there on). On PostgreSQL, ``conn`` must be in a
    transaction (planner settings are made for it)."""
    if share.of <= 1:
        return []
    if conn.dialect.name == "postgresql":
        conn.execute(text(_INDEX_SCAN_ONLY))
    params = {"lo": since_ms, "hi": before_ms, "n": limit, "celery_lag": celery_lag_ms}
    return [(r[0], r[2]) for r in conn.execute(text(_band(share.sql(others=True))), params)]


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
       :now, :outcome, {why}, :now - started_at
  FROM ax_task WHERE {where}{lock}
    ON CONFLICT (task_id, attempt) DO NOTHING"""


def _record_ended(conn: Connection, where: str, params: dict[str, Any], outcome: str,
                  why: str, *expanding: str, why_sql: str = ":ended_why") -> None:
    """Record in the history the attempts of the rows ``where`` selects, as ``outcome``,
    with ``why`` (or, per row, the SQL expression ``why_sql``, which may name it)."""
    lock = " FOR UPDATE" if conn.dialect.name == "postgresql" else ""
    stmt = text(_RECORD_ENDED.format(where=where, lock=lock, why=why_sql)).bindparams(
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
    found: dict[str, int] = {}
    for status in ("DISPATCHING", "READY"):  # one index each (ax_kombu.store.schema)
        stmt = text(f"SELECT priority, count(*) FROM ax_task WHERE status = '{status}' "
                    f"AND priority IN :priorities AND NOT {celery_bound()} GROUP BY priority"
                    ).bindparams(bindparam("priorities", expanding=True))
        for priority, n in conn.execute(stmt, {"priorities": list(priorities)}):
            found[priority] = found.get(priority, 0) + int(n)
    return found


#: a RUNNING row whose run never started: its worker listed it among its held runs
#: (ax_node.held_runs, a run listed there does not start before a write without it:
#: :mod:`ax_kombu.worker.holds`). Anything else counts as started.
UNSTARTED = ("EXISTS (SELECT 1 FROM ax_node m WHERE m.node_id = ax_task.last_run_node "
             "AND m.held_runs LIKE '%,' || CAST(ax_task.task_id AS TEXT) || ',%')")

#: a run that started and whose worker died counts a retry (FAILED when none is left); one
#: that never started (held in the stage) gets a new attempt with no retry counted
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
       last_run_node = NULL
 WHERE status = 'RUNNING' AND {{which}}
RETURNING task_id, status
"""

UNSTARTED_ERROR = "worker lost before the run started (it was staged)"

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
    params: dict[str, Any] = {"nodes": list(nodes), "now": now_ms, "error": "worker lost",
                              "unstarted_error": UNSTARTED_ERROR}
    if keep:
        params["keep"] = list(keep)
    _record_lost(conn, f"status = 'RUNNING' AND {which}", params,
                 *(["nodes", "keep"] if keep else ["nodes"]))
    return [(r[0], r[1]) for r in conn.execute(stmt, params)]


def _record_lost(conn: Connection, where: str, params: dict[str, Any], *expanding: str) -> None:
    """The history of a dead worker's RUNNING rows: "worker lost", or, for a run it had
    written down as held (never started), why it gets another attempt."""
    _record_ended(conn, where, params, "LOST", "worker lost", *expanding,
                  why_sql=f"CASE WHEN {UNSTARTED} THEN :unstarted_error ELSE :ended_why END")


def recover_orphan_running(conn: Connection, now_ms: int,
                           alive_after_ms: int) -> list[tuple[int, str]]:
    """RUNNING tasks whose worker is not alive, whatever the reason (killed, or stopped
    while the database was down so it could not record the results): retried or FAILED.

    A worker that is slow but heartbeating keeps its tasks: this never looks at age.
    """
    stmt = text(_RECOVER_RUNNING.format(which=_NOT_ALIVE))
    params = {"now": now_ms, "error": "worker lost", "alive": alive_after_ms,
              "unstarted_error": UNSTARTED_ERROR}
    _record_lost(conn, f"status = 'RUNNING' AND {_NOT_ALIVE}", params)
    return [(r[0], r[1]) for r in conn.execute(stmt, params)]


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
