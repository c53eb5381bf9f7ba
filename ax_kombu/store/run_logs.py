"""Each run's own log lines (``ax_run_log``, one row per task and attempt; archived to
``ax_run_log_archive``): all the SQL that touches them.

* :func:`write_logs` — the result writer's batch, in the transaction that records the
  runs' ends: one statement for the runs that logged anything; an attempt already
  stored is kept (``ON CONFLICT DO NOTHING``: a retried write does not double it).
* :func:`logs_of` — a task's logs by attempt, from the hot table, else the archive's.
* :func:`delete_logs` — with the task (purge, archive): nothing of a task outlives it.
  Archive copies the rows with the generic copy in :mod:`ax_kombu.store.archive`.

``lines`` is a JSON list of ``{"t", "level", "logger", "msg"}`` objects
(:class:`~ax_kombu.core.run_log.LogLine`), ``cut`` the note of what the bounds cut.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from sqlalchemy import BindParameter, Connection, Engine, Table, bindparam, delete, select
from sqlalchemy.exc import OperationalError, ProgrammingError

from ax_kombu.core.run_log import LogLine, RunLog
from ax_kombu.store.schema import run_log_archive, run_logs
from ax_kombu.store.transitions import execute_batch

#: the batch's columns, named as :func:`~ax_kombu.store.transitions.execute_batch` types them
_COLUMNS = ("id", "att", "res", "err", "at")
_INSERT = ("INSERT INTO ax_run_log (task_id, attempt, lines, cut, written_at) "
           "SELECT v.id, v.att, v.res, v.err, v.at FROM {source} "
           "ON CONFLICT (task_id, attempt) DO NOTHING")
_IDS: BindParameter[list[int]] = bindparam("ids", expanding=True)


def encoded(log: RunLog) -> str:
    """``log``'s lines as the stored JSON text."""
    return json.dumps([line.as_json() for line in log.lines], ensure_ascii=False,
                      separators=(",", ":"))


def write_logs(conn: Connection, logs: Sequence[tuple[int, int, RunLog]],
               written_at: int) -> None:
    """Store each ``(task_id, attempt, log)`` in one statement (none: no statement); an
    attempt already stored keeps its row."""
    if logs:
        execute_batch(conn, _COLUMNS, _INSERT,
                      [(task_id, attempt, encoded(log), log.cut, written_at)
                       for task_id, attempt, log in logs])


def _read(conn: Connection, table: Table, task_id: int) -> dict[int, RunLog]:
    rows = conn.execute(select(table.c.attempt, table.c.lines, table.c.cut)
                        .where(table.c.task_id == task_id).order_by(table.c.attempt))
    return {r.attempt: RunLog(tuple(LogLine.from_json(i) for i in json.loads(r.lines)), r.cut)
            for r in rows}


def logs_of(engine: Engine, task_id: int) -> dict[int, RunLog]:
    """The logs of ``task_id``'s attempts, by attempt, oldest first: from ``ax_run_log``,
    or from the archive table for an archived task (a store not migrated to 0022: none).

    Raises:
        sqlalchemy.exc.SQLAlchemyError: the database failed.
    """
    with engine.connect() as conn:
        try:
            return _read(conn, run_logs, task_id) or _read(conn, run_log_archive, task_id)
        except (ProgrammingError, OperationalError) as exc:
            if "ax_run_log" in str(exc):  # no such table: an older schema
                return {}
            raise


def delete_logs(conn: Connection, task_ids: Sequence[int]) -> int:
    """Delete the hot log rows of ``task_ids``; returns how many went."""
    if not task_ids:
        return 0
    done = conn.execute(delete(run_logs).where(run_logs.c.task_id.in_(_IDS)),
                        {"ids": list(task_ids)})
    return int(done.rowcount)
