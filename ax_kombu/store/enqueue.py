"""Writing new tasks: duplicate protection, business keys, and the write itself.

Duplicate protection holds under concurrent producers in many processes
because the check and the insert happen under one lock per key:

* PostgreSQL: transaction-scoped advisory locks on the hash buckets of
  every fingerprint and every ``(task_type, biz_key)`` in the batch, taken
  in sorted order (so two batches never deadlock), before looking for
  existing rows. Two producers of the same task serialise on that lock; the
  second one sees the first one's committed row.
* SQLite: the first statement takes the database's write lock (ax's own transactions
  begin ``IMMEDIATE``; in a caller's a write that changes nothing takes it), which
  serialises writers for the whole database.

The unique ``(task_type, biz_key)`` constraint backs the biz_key rule up.

Everything here runs in the transaction it is given (ax's own, :func:`insert_tasks`, or a
caller's, :mod:`ax_kombu.store.borrowed`): nothing begins, commits or retries.
"""

from __future__ import annotations

import csv
import hashlib
import io
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from sqlalchemy import Connection, Engine, Executable, bindparam, insert, select, text

from ax_kombu.observability import metrics
from ax_kombu.store import keys as key_holders
from ax_kombu.store.async_copy import copy_async, is_async
from ax_kombu.store.keys import Holder, Verdict
from ax_kombu.store.schema import PROBE_BUCKET_BITS, PROBE_SQL, fingerprints, tasks
from ax_kombu.store.tasks import wake_schedulers

_FINAL = frozenset({"SUCCESS", "FAILED", "CANCELLED"})
_PENDING = frozenset({"CREATED", "DELAYED", "READY"})

#: column order used for COPY
COLUMNS = ("task_id", "task_type", "trigger_time", "status", "priority", "retry_count",
           "max_retry", "timeout_ms", "processor_name", "callback_url", "payload", "biz_key",
           "fingerprint", "trace_id", "attempt", "created_at", "order_key", "order_seq", "gate",
           "shard_index", "shard_total", "runner", "traceparent", "tracestate")
#: the columns of a batch in which no task carries a trace context (migration 0022's two
#: columns left to their NULL default: a narrower COPY, and a store still at an earlier
#: revision takes such rows)
UNTRACED_COLUMNS = COLUMNS[:-2]

LOCK_KEYS = text("SELECT count(pg_advisory_xact_lock(k)) FROM "
                  "(SELECT k FROM unnest(CAST(:keys AS BIGINT[])) AS k ORDER BY k) AS s")

#: the unique index leads with task_type: without it in the condition PostgreSQL read the
#: whole index for every batch, a cost growing with the table (docs/benchmarks.md, "Issue
#: 24: ten million rows")
_FIND_BIZ = (select(tasks.c.task_type, tasks.c.biz_key, tasks.c.task_id, tasks.c.status)
             .where(tasks.c.task_type.in_(bindparam("types", expanding=True)),
                    tasks.c.biz_key.in_(bindparam("keys", expanding=True))))
#: PostgreSQL: one probe of the unique index per (type, key) pair, by both columns. With the
#: two IN lists the planner, trusting statistics that do not know a type's rows yet (a new
#: type, or one growing faster than ANALYZE runs), entered the index by the type alone and
#: filtered every row of that type by key: each batch read all the type's earlier rows
#: (1,000 more heap fetches per batch of 1,000 in ``bench.bigtable``'s keyed enqueue).
_FIND_BIZ_PG = text(
    "SELECT t.task_type, t.biz_key, t.task_id, t.status "
    "FROM unnest(CAST(:types AS TEXT[]), CAST(:keys AS TEXT[])) AS k(task_type, biz_key) "
    "JOIN ax_task AS t ON t.task_type = k.task_type AND t.biz_key = k.biz_key "
    "WHERE t.biz_key IS NOT NULL")

#: ``ax_fingerprint`` holds the pairs (written once, beside the task); the task itself says
#: whether it still counts (not cancelled, not archived or purged). SQLite: by the primary
#: key, which leads with the fingerprint.
_FIND_FP = (select(fingerprints.c.fingerprint, fingerprints.c.trigger_time,
                   fingerprints.c.task_id)
            .join(tasks, tasks.c.task_id == fingerprints.c.task_id)
            .where(fingerprints.c.fingerprint.in_(bindparam("fps", expanding=True)),
                   fingerprints.c.trigger_time > bindparam("lo"),
                   fingerprints.c.trigger_time < bindparam("hi"),
                   tasks.c.status != "CANCELLED"))

#: PostgreSQL's duplicate check finds an entry by its probe (:data:`~ax_kombu.store.schema.
#: PROBE_SQL`), so the entries of tasks due close together sit on the same few pages: a
#: batch due within the same minutes probes and adds to a handful of leaf pages, however
#: many entries the table holds (a hash index on the fingerprint spread them over the whole
#: index: one random page per task).
#: the entries whose probe is one of the batch's (the probe is a hash: an entry of another
#: fingerprint may share one; :class:`_Dedup` compares fingerprints and times). The probes
#: come as one array literal, handed to the index through a sub-select: given as a constant
#: list, the planner estimated each of the thousand elements against the expression's
#: statistics and parsed a thousand tokens, which cost more than the lookup on a small table.
_FIND_FP_PG = text(
    "SELECT f.fingerprint, f.trigger_time, f.task_id "
    "FROM ax_fingerprint AS f JOIN ax_task AS t ON t.task_id = f.task_id "
    f"WHERE {PROBE_SQL.format(t='f.')} "
    "= ANY(ARRAY(SELECT unnest(CAST(:probes AS BIGINT[])))) "
    "AND f.trigger_time > :lo AND f.trigger_time < :hi AND t.status <> 'CANCELLED'")


def probes(fingerprint: str, trigger_ms: int, window_ms: int) -> list[int]:
    """The probes (see :data:`PROBE_SQL`) under which an entry of ``fingerprint`` whose
    trigger time is less than ``window_ms`` from ``trigger_ms`` is indexed, one per bucket
    the window touches (one or two for a window up to 8 minutes, the default being 5 s; up
    to eight for an hour's)."""
    low = int(fingerprint[:8], 16)
    first = (trigger_ms - window_ms + 1) >> PROBE_BUCKET_BITS
    last = (trigger_ms + window_ms - 1) >> PROBE_BUCKET_BITS
    return [(bucket << 32) | low for bucket in range(first, last + 1)]


#: advisory locks are taken on hash buckets, not on every key: a batch of 100,000 tasks
#: then takes at most this many locks (PostgreSQL's lock table is small), and two
#: producers of unrelated tasks rarely share one.
LOCK_BUCKETS = 512
_LOCK_BASE = 0x6178_0000_0000  # "ax": keeps our advisory lock ids apart from an app's


def _lock_key(kind: str, value: str) -> int:
    digest = hashlib.blake2b(f"{kind}\0{value}".encode(), digest_size=8).digest()
    return _LOCK_BASE + int.from_bytes(digest, "big") % LOCK_BUCKETS


def _biz_ident(row: Mapping[str, Any]) -> tuple[str, str] | None:
    return (row["task_type"], row["biz_key"]) if row.get("biz_key") is not None else None


class _Dedup:
    """Decides, row by row, which rows are duplicates of existing or earlier ones, and
    what a row's key policy (:data:`KEY_POLICY`) makes of a key already taken."""

    def __init__(self, window_ms: int, by_biz: dict[tuple[str, str], Holder],
                 by_fp: dict[str, list[tuple[int, int]]]) -> None:
        self.window_ms = window_ms
        self.by_biz = by_biz
        self.by_fp = by_fp

    def judge(self, row: Mapping[str, Any]) -> Verdict:
        """The row's verdict (duplicates counted in ``ax_dedup_total`` by kind)."""
        biz = _biz_ident(row)
        holder = self.by_biz.get(biz) if biz is not None else None
        if holder is not None:
            unique, on_conflict = row.get(KEY_POLICY) or ("always", "keep")
            if holder.fresh is None and holder.status in _FINAL and unique == "pending":
                return Verdict("take", row["task_id"], holder)
            if on_conflict == "replace" and (holder.fresh is not None
                                             or holder.status in _PENDING):
                return Verdict("replace", holder.task_id, holder)
            metrics.dedup_total.labels("biz_key").inc()
            return Verdict("duplicate", holder.task_id)
        if self.window_ms > 0:
            for when, task_id in self.by_fp.get(row["fingerprint"], ()):
                if abs(when - row["trigger_time"]) < self.window_ms:
                    metrics.dedup_total.labels("fingerprint").inc()
                    return Verdict("duplicate", task_id)
        return Verdict("new", row["task_id"])

    def add(self, row: Mapping[str, Any]) -> None:
        biz = _biz_ident(row)
        if biz is not None:
            self.by_biz[biz] = Holder(row["task_id"], row["status"], row)
        self.by_fp.setdefault(row["fingerprint"], []).append((row["trigger_time"], row["task_id"]))


def _load_dedup(conn: Connection, rows: Sequence[Mapping[str, Any]], window_ms: int) -> _Dedup:
    by_biz: dict[tuple[str, str], Holder] = {}
    wanted = {b for r in rows if (b := _biz_ident(r)) is not None}
    if wanted:
        find: Executable
        if conn.dialect.name == "postgresql":  # the pairs themselves
            pairs = sorted(wanted)
            find = _FIND_BIZ_PG
            keys = {"types": [t for t, _ in pairs], "keys": [k for _, k in pairs]}
        else:  # every type with every key; the pairs wanted are picked out below
            find = _FIND_BIZ
            keys = {"types": sorted({t for t, _ in wanted}),
                    "keys": sorted({k for _, k in wanted})}
        for task_type, biz_key, task_id, status in conn.execute(find, keys):
            if (task_type, biz_key) in wanted:
                by_biz[(task_type, biz_key)] = Holder(task_id, status)
    by_fp: dict[str, list[tuple[int, int]]] = {}
    if window_ms > 0:
        times = [r["trigger_time"] for r in rows]
        params: dict[str, Any] = {"lo": min(times) - window_ms, "hi": max(times) + window_ms}
        find_fp: Executable
        if conn.dialect.name == "postgresql":
            find_fp = _FIND_FP_PG
            found = {p for r in rows for p in probes(r["fingerprint"], r["trigger_time"],
                                                     window_ms)}
            params["probes"] = "{" + ",".join(map(str, sorted(found))) + "}"
        else:
            find_fp = _FIND_FP
            params["fps"] = sorted({r["fingerprint"] for r in rows})
        for fp, when, task_id in conn.execute(find_fp, params):
            by_fp.setdefault(fp, []).append((when, task_id))
    return _Dedup(window_ms, by_biz, by_fp)


#: SQLite: a write that changes nothing, to take the database's write lock before the
#: duplicate check reads (ax's own transactions begin IMMEDIATE and hold it already; a
#: caller's transaction, :mod:`ax_kombu.store.borrowed`, may not)
_WRITE_LOCK_SQLITE = text("DELETE FROM ax_fingerprint WHERE 0")


def row_lock_keys(rows: Sequence[Mapping[str, Any]], window_ms: int) -> set[int]:
    """The PostgreSQL advisory lock keys :func:`write_tasks` takes for ``rows``: one per
    ``(task_type, biz_key)``, and one per fingerprint while the duplicate check is on. A
    writer of several slices in one transaction takes them all first (:data:`LOCK_KEYS`,
    sorted), so two such writers cannot deadlock."""
    locks = {_lock_key("b", f"{b[0]}\0{b[1]}") for r in rows if (b := _biz_ident(r)) is not None}
    if window_ms > 0:
        locks |= {_lock_key("f", r["fingerprint"]) for r in rows}
    return locks


def _lock(conn: Connection, rows: Sequence[Mapping[str, Any]], window_ms: int) -> None:
    if conn.dialect.name != "postgresql":
        conn.execute(_WRITE_LOCK_SQLITE)
        return
    locks = row_lock_keys(rows, window_ms)
    if locks:
        conn.execute(LOCK_KEYS, {"keys": sorted(locks)})


def insert_tasks(engine: Engine, rows: Sequence[Mapping[str, Any]], window_ms: int,
                 wake_before_ms: int | None = None, now_ms: int = 0) -> list[Written]:
    """:func:`write_tasks` in a transaction of its own, committed on return."""
    with engine.begin() as conn:
        return write_tasks(conn, rows, window_ms, wake_before_ms, now_ms)


#: a row's key (not a column): ``(unique, on_conflict)`` — ``unique`` ``"always"`` (a
#: biz_key is kept for good) or ``"pending"`` (kept while its task has not finished: a
#: finished holder gives it up, into ``released_key``); ``on_conflict`` ``"keep"`` (the
#: holder stays as it is) or ``"replace"`` (a pending holder takes the new payload and
#: time, as :func:`ax_kombu.store.moves.move` does)
KEY_POLICY = "key_policy"


class Written(NamedTuple):
    """One row's result: the task the caller gets, and what happened to it."""

    task_id: int
    created: bool
    replaced: bool = False


def write_tasks(conn: Connection, rows: Sequence[Mapping[str, Any]], window_ms: int,
                wake_before_ms: int | None = None, now_ms: int = 0) -> list[Written]:
    """Insert ``rows`` (complete task rows) unless they duplicate a task, in ``conn``'s
    transaction (ax's own, or a caller's: nothing here begins, commits or retries).

    A row is a duplicate when a task with the same ``(task_type, biz_key)``
    exists, or a non-cancelled task with the same fingerprint was enqueued for a
    trigger time less than ``window_ms`` away (``window_ms == 0`` turns that off; the
    fingerprints are written all the same, so turning it on again sees every task).
    Rows earlier in the same batch count as existing. A row's :data:`KEY_POLICY` may
    instead take a finished holder's key, or replace a pending holder's payload and time.

    If a new or moved task is due before ``wake_before_ms``, schedulers are woken
    (PostgreSQL ``NOTIFY``, delivered when the transaction commits) so a task
    due inside the window they already loaded still fires on time.

    Returns:
        For each row, in order: the new id, or the id of the task it duplicates
        (``created=False``) or replaced (``replaced=True``).
    """
    _lock(conn, rows, window_ms)
    dedup = _load_dedup(conn, rows, window_ms)
    verdicts: list[Verdict] = []
    for row in rows:
        verdict = dedup.judge(row)
        if verdict.creates:
            dedup.add(row)
        verdicts.append(verdict)
    verdicts = key_holders.settle(conn, rows, verdicts, now_ms)
    fresh = [row for row, v in zip(rows, verdicts, strict=True) if v.creates]
    _write(conn, fresh)
    _wake(conn, [*fresh, *(r for r, v in zip(rows, verdicts, strict=True)
                           if v.kind == "replace")], wake_before_ms)
    return [Written(v.task_id, v.creates, v.kind == "replace") for v in verdicts]


def _wake(conn: Connection, rows: Sequence[Mapping[str, Any]], before_ms: int | None) -> None:
    if before_ms is None or not rows:
        return
    first = min(r["trigger_time"] for r in rows)
    if first < before_ms:
        wake_schedulers(conn, first)


#: the columns of ``ax_fingerprint``, each read from the task row of the same name
FP_COLUMNS = ("fingerprint", "trigger_time", "task_id")


def _write(conn: Connection, rows: Sequence[Mapping[str, Any]]) -> None:
    if not rows:
        return
    columns = COLUMNS if any(r.get("traceparent") for r in rows) else UNTRACED_COLUMNS
    if conn.dialect.name == "postgresql" and len(rows) > 20:
        _copy(conn, "ax_task", columns, rows)
        _copy(conn, "ax_fingerprint", FP_COLUMNS, rows)
    else:
        conn.execute(insert(tasks), [{c: r.get(c) for c in columns} for r in rows])
        conn.execute(insert(fingerprints), [{c: r[c] for c in FP_COLUMNS} for r in rows])


def _copy(conn: Connection, table: str, columns: Sequence[str],
          rows: Sequence[Mapping[str, Any]]) -> None:
    """PostgreSQL COPY: several times faster than a multi-row INSERT; through psycopg2's
    ``copy_expert`` or psycopg 3's ``copy`` (a caller's connection may be either).

    In COPY's CSV format an unquoted empty field is NULL; every text column
    ax writes here is validated non-empty, so ``None`` is the only empty field.
    """
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows([row.get(c) for c in columns] for row in rows)
    sql = f"COPY {table} ({', '.join(columns)}) FROM STDIN WITH (FORMAT csv)"
    if is_async(conn.connection.driver_connection):  # ax_kombu.aio's write
        copy_async(conn.connection.driver_connection, sql, table, columns, buf.getvalue())
        return
    cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
    try:
        if hasattr(cursor, "copy_expert"):
            buf.seek(0)
            cursor.copy_expert(sql, buf)
        else:
            with cursor.copy(sql) as copy:
                copy.write(buf.getvalue())
    finally:
        cursor.close()
