"""The preload: the scheduler's reads of the next window of the task table.

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
are scattered over as many pages as tasks, each fetched, so a busy preload read from
``ax_task`` grows with the table (docs/benchmarks.md, "Issue 24: ten million rows"). The invariant
(migration 0016): a claimable, unparked task has an entry at its current trigger time,
armed no earlier than the transaction that made it so.

An entry may be out of date — its task since claimed, cancelled, parked or moved to
another time. It is handed over all the same: the claim's compare-and-set checks the
status and the trigger time and refuses it, and one moved later is handed back at its
real time (:func:`~ax_kombu.store.claims.still_claimable`); the timing loop keeps the
earlier of two times for an id it keeps, so an out-of-date later time never delays a
task. :func:`prune_due` deletes the entries whose time has passed and whose task has
moved on (never one whose task is still due then, however late). A row read twice is
harmless for the same reasons. The recovery scans (a task a worker or a broker lost) are
in :mod:`ax_kombu.store.recovery`.

**Pauses** (:mod:`ax_kombu.store.pauses`): while a task type or queue is paused, every read
here leaves its tasks out (on ``ax_task`` by its columns; on ``ax_due`` by a primary-key
probe of the entry's task, which costs a round only while something is paused). Nothing
is filtered, and no statement changes, while nothing is paused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from sqlalchemy import Connection, TextClause, text

from ax_kombu.store.claims import fire_time
from ax_kombu.store.pauses import NONE, Paused, bind, due_filter, task_filter
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
    """``share``: the share's SQL, and the pause filter while something is paused."""
    # three ordered ranges of (status, trigger_time), merged: an IN list would sort them all
    parts = " UNION ALL ".join(_band_one(s, share, a) for s, a in
                               (("CREATED", "c"), ("DELAYED", "d"), ("READY", "r")))
    return f"SELECT task_id, trigger_time, fire FROM ({parts}) AS b ORDER BY trigger_time LIMIT :n"


def _tied(share: str) -> str:
    return (f"SELECT task_id, trigger_time, {fire_time()} FROM ax_task WHERE {CLAIMABLE} "
            f"AND trigger_time = :at AND {UNPARKED}{share}")


def _text(sql: str, paused: Paused) -> TextClause:
    """``sql`` as executed, with the paused lists bound while something is paused."""
    return bind(text(sql), paused) if paused.any else text(sql)


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
# claim moved on left a dead index entry (one per claimed task) until VACUUM. A plain
# index scan marks such entries dead as it passes them, so the next preload skips them for
# free; a bitmap scan, which the planner picks on a young table's small estimates, never
# does and visits them all again each time, so each preload costs more the longer a load
# runs (docs/benchmarks.md, "Scheduler alone after the thread split"). And on stale
# estimates the planner may read a whole index of the claimable rows and sort it
# (``ax_task``'s ``armed`` index, before migration 0018, even with no row in the band:
# docs/benchmarks.md, "Issue 21, fifth session"). So, for this transaction only, neither:
_INDEX_SCAN_ONLY = ("SELECT set_config('enable_bitmapscan', 'off', true), "
                    "set_config('enable_sort', 'off', true)")


def _dialect(conn: Connection) -> str:
    return "postgresql" if conn.dialect.name == "postgresql" else "sqlite"


def read_mark(conn: Connection) -> Mark:
    """What a read made now can see (read it *before* the rows: see the module docstring)."""
    xmax, xip = conn.execute(text(_MARK[_dialect(conn)])).one()
    return Mark(int(xmax), tuple(int(x) for x in xip or ()))


def preload(conn: Connection, loaded: Loaded, horizon_ms: int, limit: int,
            share: Share = ALL, celery_lag_ms: int = 0, paused: Paused = NONE
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
        (planner settings are made for it alone). ``paused``'s tasks are left out.
    """
    dialect = _dialect(conn)
    mark = read_mark(conn)
    where = share.sql()
    params: dict[str, Any] = {"lo": loaded.until, "hi": horizon_ms, "n": limit,
                              "claim_lead": celery_lag_ms, **paused.params()}
    seen = loaded.mark if loaded.until > 0 else None  # None: nothing read yet
    fire = fire_time()
    due = where + due_filter(paused, "ax_due.task_id")
    band_sql, tied_sql = ((_band(where + task_filter(paused)),
                           _tied(where + task_filter(paused))) if seen is None else
                          (_DUE_BAND.format(fire=fire, share=due),
                           _DUE_TIED.format(fire=fire, share=due)))
    changed: list[Any] = []
    if seen is not None:  # first: it may need a bitmap scan
        params.update(xmax=seen.xmax, xip=list(seen.xip))
        changed = list(conn.execute(_text(_DUE_CHANGED.format(
            fire=fire, share=where + due_filter(paused, "c.task_id"),
            changed=changed_since(seen, dialect)), paused), params))
    if dialect == "postgresql":
        conn.execute(text(_INDEX_SCAN_ONLY))
    band = list(conn.execute(_text(band_sql, paused), params))
    until = max(horizon_ms, loaded.until)
    if len(band) >= limit:  # the rest of the last instant too, then go on after it
        last = band[-1][1]
        band = [r for r in band if r[1] < last]
        band += conn.execute(_text(tied_sql, paused), {**params, "at": last})
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
                      celery_lag_ms: int = 0, since_ms: int = 0,
                      paused: Paused = NONE) -> list[tuple[int, int]]:
    """Claimable tasks of the *other* shares due before ``before_ms``: those of a
    scheduler killed or paused and not yet past its silence window (it still counts as
    live, so nobody else reads its share), of one that beats but cannot preload (its
    database calls fail while its heartbeat's do not), or of a share nobody read while
    the schedulers disagreed on who is alive. At most ``limit``, oldest first, as
    :func:`preload` returns them; none for a scheduler alone. ``since_ms``: only those
    due at or after it (the index ranges start there: parked tasks, READY in the same
    range, are walked only from there on). ``paused``'s tasks are left out. On PostgreSQL,
    ``conn`` must be in a transaction (planner settings are made for it)."""
    if share.of <= 1:
        return []
    if conn.dialect.name == "postgresql":
        conn.execute(text(_INDEX_SCAN_ONLY))
    params = {"lo": since_ms, "hi": before_ms, "n": limit, "claim_lead": celery_lag_ms,
              **paused.params()}
    sql = _band(share.sql(others=True) + task_filter(paused))
    return [(r[0], r[2]) for r in conn.execute(_text(sql, paused), params)]
