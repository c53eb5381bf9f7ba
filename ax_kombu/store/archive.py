"""Archiving: finished tasks and their attempts out of the hot tables (``ax archive``,
``AX_RETENTION``), into the archive tables or a gzip JSONL file.

What moves: every task SUCCESS, FAILED or CANCELLED whose ``finished_at`` is older
than the cutoff (the database clock minus ``older_than_ms``, read once per run),
with its ``ax_attempt`` and ``ax_run_log`` rows (each run's own log lines). Nothing else
is read or written.

A run is a series of batches, each one short transaction of at most ``batch`` tasks:

1. **choose** — ``SELECT task_id … ORDER BY task_id LIMIT batch``, with
   ``FOR UPDATE SKIP LOCKED`` on PostgreSQL: the chosen rows are locked, rows
   another transaction holds are passed over (SQLite: the batch's
   ``BEGIN IMMEDIATE`` holds the database's write lock instead);
2. **copy** — into ``ax_task_archive`` / ``ax_attempt_archive`` (``INSERT … SELECT
   … ON CONFLICT DO NOTHING``), or as one JSON line per task (its attempts as a
   list) appended to the file, flushed and ``fsync``-ed;
3. **delete** the ``ax_attempt`` rows, then the ``ax_task`` rows, of exactly the
   chosen ids; commit.

Guarantees, on PostgreSQL and SQLite alike:

* **Nothing is lost.** A row leaves the hot tables only in the transaction that
  copied it to the archive tables, or after its line is durably in the file.
* **Resumable.** A run stopped anywhere (a crash, ``kill -9``, ``--limit``) leaves
  each batch wholly moved or not moved at all; the next run carries on. The
  archive tables never hold a task twice (primary keys; a conflicting copy is
  skipped, never doubled).
* **The file** (``--to``) holds one JSON object per line and task: its columns
  (``payload`` and ``result`` as JSON values), ``attempts``, its ``ax_attempt``
  rows, and ``logs``, its ``ax_run_log`` rows (``lines`` as the JSON list they
  hold). It is appended to, one gzip member per batch (``zcat``,
  Python's :mod:`gzip` and most readers read concatenated members). A crash
  *during* a write leaves a torn member at the end: the next run on that file
  cuts it off before it appends (those rows were not deleted and are written
  again). A crash *after* the ``fsync`` but before the delete commits leaves
  that batch (at most ``batch`` tasks) in the file and in the hot table: the next
  run writes it again, so **a line may appear twice; readers dedupe by task_id**
  (the two copies are equal unless the task was retried in between; the later
  line is the newer). Two runs on one file at once are refused (``flock``).
* **Claims are never blocked** (PostgreSQL). A claim moves only DELAYED and
  READY rows; a batch locks only finished rows, for one short transaction, and
  skips rows another archiver (a second scheduler's retention, a concurrent ``ax
  archive``) holds, so concurrent runs share the work without waiting on each
  other. Only an ``ax retry`` of a task in the batch being moved waits, for that
  batch; it then finds the task gone. On SQLite every writer, a claim too, waits
  for the one write lock: at most one batch's transaction (keep ``batch`` small).

The scan walks the primary key, not ``finished_at``: task ids are snowflakes that
carry their creation time (:mod:`ax_kombu.core.ids`), and a task finishes after
it is created, so every task finished before the cutoff has an id below the
cutoff's (``compose(cutoff + 1, 0, 0)``). A run reads each candidate once
(keyset: after the last id of the batch before), never reads a task created
after the cutoff, and needs no ``finished_at`` index on the hot table (one would
cost every finishing update an index entry). Tasks move oldest-created first.

The record of operator actions (``ax_audit``) follows the same cutoff: after the tasks,
every record older than it moves to ``ax_audit_archive`` (:func:`ax_kombu.store.audit.
archive_before`), ``batch`` per transaction, whether the tasks went to the tables or to a
file (the record stays in the database), unless the run was stopped or reached its
``limit``.

Every function here raises :class:`~ax_kombu.exceptions.StoreError` when the
database fails, :class:`~ax_kombu.exceptions.ValidationError` on bad input.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import BindParameter, Connection, Engine, Table, bindparam, delete, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import OperationalError, ProgrammingError

from ax_kombu.core.ids import compose
from ax_kombu.core.states import FINAL
from ax_kombu.exceptions import ValidationError
from ax_kombu.store.admin import BATCH_MAX, _guarded, check_count
from ax_kombu.store.archive_file import JsonlGzFile
from ax_kombu.store.audit import archive_before
from ax_kombu.store.engine import db_now_ms
from ax_kombu.store.moves import forget_moves
from ax_kombu.store.run_logs import delete_logs
from ax_kombu.store.schema import (
    attempt_archive,
    attempts,
    run_log_archive,
    run_logs,
    task_archive,
    tasks,
)
from ax_kombu.store.tasks import final_attempt, forget_fingerprints

#: tasks moved per transaction unless told otherwise
BATCH_DEFAULT = 1000
_FINAL = sorted(str(s) for s in FINAL)


@dataclass(frozen=True)
class Archived:
    """What a run moved: tasks, ``ax_attempt`` rows, the batches it took, and
    ``ax_audit`` records."""

    tasks: int = 0
    attempts: int = 0
    batches: int = 0
    audit: int = 0

    def __add__(self, other: Archived) -> Archived:
        return Archived(self.tasks + other.tasks, self.attempts + other.attempts,
                        self.batches + other.batches, self.audit + other.audit)


@dataclass(frozen=True)
class Pace:
    """How a run yields to the live load: ``pause_s`` after each batch (through ``wait``),
    and ``stop()`` asked before each batch (True ends the run there)."""

    pause_s: float = 0.0
    stop: Callable[[], bool] = lambda: False
    wait: Callable[[float], object] = time.sleep


def archive_finished(engine: Engine, older_than_ms: int, *, batch: int = BATCH_DEFAULT,
                     limit: int | None = None, to: Path | None = None,
                     pace: Pace = Pace()) -> Archived:
    """Move the tasks that finished more than ``older_than_ms`` ago, with their attempts,
    to the archive tables (or to the gzip JSONL file ``to``), ``batch`` per transaction.

    Args:
        older_than_ms: only tasks whose ``finished_at`` is older than this (database clock).
        batch: most tasks per transaction (1 to :data:`~ax_kombu.store.admin.BATCH_MAX`).
        limit: stop after this many tasks (None: until none is left).
        to: a file to append to instead of the archive tables.
        pace: a pause between batches (less load on a busy database, a slower run),
            and when to stop.
    Returns:
        How many tasks and attempt rows moved, in how many batches.
    Raises:
        ValidationError: a negative age, a bad batch or limit, or a file that is not
            one ``ax archive`` writes (or is being written by another run).
        StoreError: the database failed; the batches committed before stay moved.
    """
    if older_than_ms < 0:
        raise ValidationError(f"--older-than must not be negative, not {older_than_ms} ms")
    check_count("--batch", batch, BATCH_MAX)
    if limit is not None:
        check_count("--limit", limit)
    if pace.pause_s < 0:
        raise ValidationError(f"--pause must not be negative, not {pace.pause_s} s")
    out = JsonlGzFile(to) if to is not None else None
    try:
        return _guarded(engine, lambda: _run(engine, older_than_ms, batch, limit, out, pace))
    finally:
        if out is not None:
            out.close()


def _run(engine: Engine, older_than_ms: int, batch: int, limit: int | None,
         out: JsonlGzFile | None, pace: Pace) -> Archived:
    with engine.connect() as conn:
        cutoff = db_now_ms(conn) - older_than_ms
    done, after = Archived(), -1
    while limit is None or done.tasks < limit:
        if done.batches and pace.pause_s:
            pace.wait(pace.pause_s)
        if pace.stop():
            break
        size = batch if limit is None else min(batch, limit - done.tasks)
        with engine.begin() as conn:
            ids = _choose(conn, cutoff, after, size)
            if not ids:
                break
            moved = _to_file(conn, ids, out) if out is not None else _to_tables(conn, ids)
        done += Archived(len(ids), moved, 1)
        after = ids[-1]
    if (limit is None or done.tasks < limit) and not pace.stop():
        done += Archived(audit=_audit(engine, cutoff, batch, pace))
    return done


def _audit(engine: Engine, cutoff: int, batch: int, pace: Pace) -> int:
    """Move the audit records older than ``cutoff`` to their archive; returns how many."""
    moved = 0
    while not pace.stop():
        with engine.begin() as conn:
            count = archive_before(conn, cutoff, batch)
        moved += count
        if count < batch:
            break
        if pace.pause_s:
            pace.wait(pace.pause_s)
    return moved


def _choose(conn: Connection, cutoff: int, after: int, size: int) -> list[int]:
    """Up to ``size`` ids of tasks finished before ``cutoff``, after ``after``, locked."""
    stmt = (select(tasks.c.task_id)
            .where(tasks.c.task_id > after, tasks.c.task_id < compose(cutoff + 1, 0, 0),
                   tasks.c.status.in_(_FINAL), tasks.c.finished_at < cutoff)
            .order_by(tasks.c.task_id).limit(size))
    if conn.dialect.name == "postgresql":
        stmt = stmt.with_for_update(skip_locked=True)
    return [r[0] for r in conn.execute(stmt)]


_IDS: BindParameter[list[int]] = bindparam("ids", expanding=True)
_DELETE_ATTEMPTS = delete(attempts).where(attempts.c.task_id.in_(_IDS))
_DELETE_TASKS = (delete(tasks).where(tasks.c.task_id.in_(_IDS))
                 .returning(tasks.c.task_id, tasks.c.fingerprint))


def _to_tables(conn: Connection, ids: Sequence[int]) -> int:
    """Copy the tasks ``ids`` and their attempts to the archive tables, delete them from
    the hot ones; returns the attempt rows moved."""
    for target, source in ((task_archive, tasks), (attempt_archive, attempts),
                           (run_log_archive, run_logs)):
        conn.execute(_copy(conn, target, source), {"ids": list(ids)})
    return _delete(conn, ids)


def _copy(conn: Connection, target: Table, source: Table) -> Any:
    """``INSERT INTO target SELECT … FROM source WHERE task_id IN :ids ON CONFLICT DO
    NOTHING`` (the dialect's own insert: both have the clause)."""
    insert = postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert
    names = [c.name for c in target.columns]
    rows = select(*(source.c[n] for n in names)).where(source.c.task_id.in_(_IDS))
    return insert(target).from_select(names, rows).on_conflict_do_nothing()


def _delete(conn: Connection, ids: Sequence[int]) -> int:
    moved = conn.execute(_DELETE_ATTEMPTS, {"ids": list(ids)}).rowcount
    delete_logs(conn, ids)
    forget_moves(conn, ids)  # a task's moves are not archived (docstring of ax_move)
    forget_fingerprints(conn, [(r[0], r[1]) for r in conn.execute(_DELETE_TASKS,
                                                                 {"ids": list(ids)})])
    return int(moved)


def _to_file(conn: Connection, ids: Sequence[int], out: JsonlGzFile) -> int:
    """Append the tasks ``ids`` (each with its attempts) to ``out`` durably, then delete
    them; returns the attempt rows moved."""
    history: dict[int, list[dict[str, Any]]] = {i: [] for i in ids}
    for a in conn.execute(select(attempts).where(attempts.c.task_id.in_(_IDS))
                          .order_by(attempts.c.task_id, attempts.c.attempt), {"ids": list(ids)}):
        history[a.task_id].append(dict(a._mapping))
    logs: dict[int, list[dict[str, Any]]] = {i: [] for i in ids}
    for r in conn.execute(select(run_logs).where(run_logs.c.task_id.in_(_IDS))
                          .order_by(run_logs.c.task_id, run_logs.c.attempt), {"ids": list(ids)}):
        logs[r.task_id].append({**r._mapping, "lines": json.loads(r.lines)})
    rows = conn.execute(select(tasks).where(tasks.c.task_id.in_(_IDS))
                        .order_by(tasks.c.task_id), {"ids": list(ids)})
    out.append([_line({**r._mapping, "logs": logs[r.task_id]}, history[r.task_id])
                for r in rows])
    return _delete(conn, ids)


def _line(row: Mapping[str, Any], history: list[dict[str, Any]]) -> str:
    """One task as a JSON line: its columns, ``payload`` and ``result`` as the JSON values
    they hold (not as text), and ``attempts``: its ``ax_attempt`` rows, oldest first."""
    task = {**row, "attempts": history}
    for name in ("payload", "result"):
        if task[name] is not None:
            task[name] = json.loads(task[name])
    return json.dumps(task, ensure_ascii=False, separators=(",", ":"))


def fetch_archived(conn: Connection, task_id: int) -> tuple[dict[str, Any],
                                                            list[dict[str, Any]]] | None:
    """The archived row of ``task_id`` and its ended attempts (as
    :func:`ax_kombu.store.tasks.attempts_of` lists them), or None if it is not in the
    archive tables (or the schema has none yet: a store not migrated to 0008)."""
    try:
        row = conn.execute(select(task_archive)
                           .where(task_archive.c.task_id == task_id)).first()
        if row is None:
            return None
        found = [dict(r._mapping) for r in conn.execute(
            select(attempt_archive).where(attempt_archive.c.task_id == task_id)
            .order_by(attempt_archive.c.attempt))]
    except (ProgrammingError, OperationalError):  # no such table (the caller's
        return None                               # connection rolls back on close)
    task = dict(row._mapping)
    last = final_attempt(task)
    if last is not None and all(a["attempt"] != last["attempt"] for a in found):
        found.append(last)
    return task, found
