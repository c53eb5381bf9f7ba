"""Writing new tasks with duplicate protection, and reading them back.

Duplicate protection holds under concurrent producers in many processes
because the check and the insert happen under one lock per key:

* PostgreSQL: transaction-scoped advisory locks on the hash buckets of
  every fingerprint and every ``(task_type, biz_key)`` in the batch, taken
  in sorted order (so two batches never deadlock), before looking for
  existing rows. Two producers of the same task serialise on that lock; the
  second one sees the first one's committed row.
* SQLite: every write transaction is ``BEGIN IMMEDIATE``, which serialises
  writers for the whole database.

The unique ``(task_type, biz_key)`` constraint backs the biz_key rule up.
"""

from __future__ import annotations

import csv
import hashlib
import io
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Connection, Engine, Executable, Row, bindparam, insert, select, text

from ax_kombu.observability import metrics
from ax_kombu.store.schema import PROBE_BUCKET_BITS, PROBE_SQL, attempts, fingerprints, tasks

#: column order used for COPY
COLUMNS = ("task_id", "task_type", "trigger_time", "status", "priority", "retry_count",
           "max_retry", "timeout_ms", "processor_name", "callback_url", "payload", "biz_key",
           "fingerprint", "trace_id", "attempt", "created_at", "order_key", "order_seq", "gate",
           "shard_index", "shard_total", "runner")

_LOCK_KEYS = text("SELECT count(pg_advisory_xact_lock(k)) FROM "
                  "(SELECT k FROM unnest(CAST(:keys AS BIGINT[])) AS k ORDER BY k) AS s")

#: the unique index leads with task_type: without it in the condition PostgreSQL read the
#: whole index for every batch (120 ms per 1,000 tasks at 1M rows, growing with the table)
_FIND_BIZ = (select(tasks.c.task_type, tasks.c.biz_key, tasks.c.task_id)
             .where(tasks.c.task_type.in_(bindparam("types", expanding=True)),
                    tasks.c.biz_key.in_(bindparam("keys", expanding=True))))
#: PostgreSQL: one probe of the unique index per (type, key) pair, by both columns. With the
#: two IN lists the planner, trusting statistics that do not know a type's rows yet (a new
#: type, or one growing faster than ANALYZE runs), entered the index by the type alone and
#: filtered every row of that type by key: each batch read all the type's earlier rows
#: (1,000 more heap fetches per batch of 1,000 in ``bench.bigtable``'s keyed enqueue).
_FIND_BIZ_PG = text(
    "SELECT t.task_type, t.biz_key, t.task_id "
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
#: then holds at most this many locks (PostgreSQL's lock table is small), and two
#: producers of unrelated tasks rarely share one.
LOCK_BUCKETS = 512
_LOCK_BASE = 0x6178_0000_0000  # "ax": keeps our advisory lock ids apart from an app's


def _lock_key(kind: str, value: str) -> int:
    digest = hashlib.blake2b(f"{kind}\0{value}".encode(), digest_size=8).digest()
    return _LOCK_BASE + int.from_bytes(digest, "big") % LOCK_BUCKETS


def _biz_ident(row: Mapping[str, Any]) -> tuple[str, str] | None:
    return (row["task_type"], row["biz_key"]) if row.get("biz_key") is not None else None


class _Dedup:
    """Decides, row by row, which rows are duplicates of existing or earlier ones."""

    def __init__(self, window_ms: int, by_biz: dict[tuple[str, str], int],
                 by_fp: dict[str, list[tuple[int, int]]]) -> None:
        self.window_ms = window_ms
        self.by_biz = by_biz
        self.by_fp = by_fp

    def existing(self, row: Mapping[str, Any]) -> int | None:
        """The task ``row`` duplicates, if any (counted in ``ax_dedup_total`` by kind)."""
        biz = _biz_ident(row)
        if biz is not None and biz in self.by_biz:
            metrics.dedup_total.labels("biz_key").inc()
            return self.by_biz[biz]
        if self.window_ms > 0:
            for when, task_id in self.by_fp.get(row["fingerprint"], ()):
                if abs(when - row["trigger_time"]) < self.window_ms:
                    metrics.dedup_total.labels("fingerprint").inc()
                    return task_id
        return None

    def add(self, row: Mapping[str, Any]) -> None:
        biz = _biz_ident(row)
        if biz is not None:
            self.by_biz[biz] = row["task_id"]
        self.by_fp.setdefault(row["fingerprint"], []).append((row["trigger_time"], row["task_id"]))


def _load_dedup(conn: Connection, rows: Sequence[Mapping[str, Any]], window_ms: int) -> _Dedup:
    by_biz: dict[tuple[str, str], int] = {}
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
        for task_type, biz_key, task_id in conn.execute(find, keys):
            if (task_type, biz_key) in wanted:
                by_biz[(task_type, biz_key)] = task_id
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


def _lock(conn: Connection, rows: Sequence[Mapping[str, Any]], window_ms: int) -> None:
    if conn.dialect.name != "postgresql":
        return  # BEGIN IMMEDIATE already holds SQLite's single write lock
    keys = {_lock_key("b", f"{b[0]}\0{b[1]}") for r in rows if (b := _biz_ident(r)) is not None}
    if window_ms > 0:
        keys |= {_lock_key("f", r["fingerprint"]) for r in rows}
    if keys:
        conn.execute(_LOCK_KEYS, {"keys": sorted(keys)})


def insert_tasks(engine: Engine, rows: Sequence[Mapping[str, Any]], window_ms: int,
                 wake_before_ms: int | None = None) -> list[tuple[int, bool]]:
    """Insert ``rows`` (complete task rows) unless they duplicate a task.

    A row is a duplicate when a task with the same ``(task_type, biz_key)``
    exists, or a non-cancelled task with the same fingerprint was enqueued for a
    trigger time less than ``window_ms`` away (``window_ms == 0`` turns that off; the
    fingerprints are written all the same, so turning it on again sees every task).
    Rows earlier in the same batch count as existing.

    If a new task is due before ``wake_before_ms``, schedulers are woken
    (PostgreSQL ``NOTIFY``, delivered when the transaction commits) so a task
    due inside the window they already loaded still fires on time.

    Returns:
        For each row, in order: ``(task_id, created)`` — the new id, or the
        id of the task it duplicates with ``created=False``.
    """
    with engine.begin() as conn:
        _lock(conn, rows, window_ms)
        dedup = _load_dedup(conn, rows, window_ms)
        results: list[tuple[int, bool]] = []
        fresh: list[Mapping[str, Any]] = []
        for row in rows:
            found = dedup.existing(row)
            if found is None:
                dedup.add(row)
                fresh.append(row)
            results.append((found if found is not None else row["task_id"], found is None))
        _write(conn, fresh)
        _wake(conn, fresh, wake_before_ms)
    return results


WAKE_CHANNEL = "ax_wakeup"


def _wake(conn: Connection, rows: Sequence[Mapping[str, Any]], before_ms: int | None) -> None:
    if before_ms is None or not rows:
        return
    first = min(r["trigger_time"] for r in rows)
    if first < before_ms:
        wake_schedulers(conn, first)


def wake_schedulers(conn: Connection, first_due_ms: int) -> None:
    """Tell schedulers (on commit) that a task due at ``first_due_ms`` waits to be loaded.

    PostgreSQL only; on SQLite the schedulers poll every 50 ms instead.
    """
    if conn.dialect.name == "postgresql":
        conn.execute(text("SELECT pg_notify(:channel, :first)"),
                     {"channel": WAKE_CHANNEL, "first": str(first_due_ms)})


#: the columns of ``ax_fingerprint``, each read from the task row of the same name
FP_COLUMNS = ("fingerprint", "trigger_time", "task_id")


def _write(conn: Connection, rows: Sequence[Mapping[str, Any]]) -> None:
    if not rows:
        return
    if conn.dialect.name == "postgresql" and len(rows) > 20:
        _copy(conn, "ax_task", COLUMNS, rows)
        _copy(conn, "ax_fingerprint", FP_COLUMNS, rows)
    else:
        conn.execute(insert(tasks), [{c: r.get(c) for c in COLUMNS} for r in rows])
        conn.execute(insert(fingerprints), [{c: r[c] for c in FP_COLUMNS} for r in rows])


def _copy(conn: Connection, table: str, columns: Sequence[str],
          rows: Sequence[Mapping[str, Any]]) -> None:
    """PostgreSQL COPY: several times faster than a multi-row INSERT.

    In COPY's CSV format an unquoted empty field is NULL; every text column
    ax writes here is validated non-empty, so ``None`` is the only empty field.
    """
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows([row.get(c) for c in columns] for row in rows)
    buf.seek(0)
    cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
    try:
        cursor.copy_expert(f"COPY {table} ({', '.join(columns)}) FROM STDIN WITH (FORMAT csv)",
                           buf)
    finally:
        cursor.close()


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
            "node": row["last_run_node"], "trigger_time": row["trigger_time"],
            "dispatched_at": row["dispatched_at"], "started_at": started,
            "finished_at": row["finished_at"], "outcome": row["status"],
            "error": None if row["status"] == "SUCCESS" else row["last_error"],
            "duration_ms": row["finished_at"] - started if started is not None else None}


#: copies a finished task's final attempt into the history before ``ax retry`` reuses the row
_KEEP_FINAL = """
INSERT INTO ax_attempt (task_id, attempt, task_type, node, trigger_time, dispatched_at,
                        started_at, finished_at, outcome, error, duration_ms)
SELECT task_id, attempt, task_type, last_run_node, trigger_time, dispatched_at, started_at,
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
