"""The SQL of per-type alerts (:mod:`ax_kombu.alerts`): the ``ax_alert`` rows, the events
an evaluator counts, and the compare-and-set that moves an alert's incident state.

Events are read from ``ax_task`` over a window of time ``(since, until]`` that every
evaluator pass moves forward, with the indexes the table already has:

* **failed**: a task of the type that ended FAILED (final: a retried failure is DELAYED)
  with ``finished_at`` in the window. Read through ``(status, trigger_time)``, bounded
  below by :data:`FAILED_LOOKBACK_MS`: a task due more than that before its failure
  (waiting a day, then failing) is not counted.
* **late**: a task of the type whose ``trigger_time + late_after`` falls in the window and
  that had not started by then: still waiting or dispatched, or started past it. Each
  late task is counted once, at the moment it became late, whether it has started since
  or not. Read per state: the waiting and finished ones through ``(status,
  trigger_time)``, the in-flight ones through ``(task_type, status)``.

:func:`advance` is the one write of the evaluator: it moves ``checked_until`` (and the
incident columns) only if ``checked_until`` is still what the caller read, so among
schedulers evaluating the same alert at once exactly one wins each window, and only the
winner sends what the move means. When the move opens or closes an incident it appends
its message to the row's ``outbox`` in the same statement, so a message is never lost with
the scheduler that won it: :func:`take_out` removes it once delivered, and
:func:`take_over_outbox` lets any scheduler take over messages whose takeover time
(``outbox_claimed_until``) has passed.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from sqlalchemy import Connection, delete, select, text, update
from sqlalchemy.dialects import postgresql, sqlite

from ax_kombu.store.schema import alerts

#: a failure is looked for among tasks due at most this long before the window
FAILED_LOOKBACK_MS = 86_400_000

_FAILED = text(
    "SELECT count(*) AS n, min(task_id) AS sample, max(finished_at) AS last FROM ax_task "
    "WHERE status = 'FAILED' AND trigger_time > :lookback "
    "AND task_type = :t AND finished_at > :since AND finished_at <= :until")
# lateness crossed in the window: trigger_time + late in (since, until]
_LATE_WAITING_OR_DONE = text(
    "SELECT count(*) AS n, min(task_id) AS sample FROM ax_task "
    "WHERE status IN ('CREATED', 'DELAYED', 'READY', 'SUCCESS', 'FAILED') "
    "AND trigger_time > :since - :late AND trigger_time <= :until - :late "
    "AND task_type = :t AND (started_at IS NULL OR started_at > trigger_time + :late)")
_LATE_IN_FLIGHT = text(
    "SELECT count(*) AS n, min(task_id) AS sample FROM ax_task "
    "WHERE task_type = :t AND status IN ('DISPATCHING', 'RUNNING') "
    "AND trigger_time > :since - :late AND trigger_time <= :until - :late "
    "AND (started_at IS NULL OR started_at > trigger_time + :late)")


class Events(NamedTuple):
    """What one window of one alert found."""

    failed: int = 0
    late: int = 0
    #: a task id among them (the smallest; None: none found)
    sample_task_id: int | None = None

    @property
    def total(self) -> int:
        return self.failed + self.late


def _min(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)


def events(conn: Connection, alert: dict[str, Any], since: int, until: int) -> Events:
    """The events of ``alert`` (an ``ax_alert`` row as a dict) in ``(since, until]``."""
    failed, late, sample = 0, 0, None
    t = alert["task_type"]
    if alert["on_failed"]:
        row = conn.execute(_FAILED, {"t": t, "since": since, "until": until,
                                     "lookback": since - FAILED_LOOKBACK_MS}).one()
        failed, sample = int(row.n), row.sample
    if alert["on_late"]:
        params = {"t": t, "since": since, "until": until, "late": alert["late_after_ms"]}
        for query in (_LATE_WAITING_OR_DONE, _LATE_IN_FLIGHT):
            row = conn.execute(query, params).one()
            late += int(row.n)
            sample = _min(sample, row.sample)
    return Events(failed, late, sample)


def upsert(conn: Connection, values: dict[str, Any], now_ms: int) -> None:
    """Write the alert of ``values["task_type"]``: a new one starts with no incident and
    its window at ``now_ms``; an existing one keeps its incident state and window."""
    settings = {k: values[k] for k in ("on_failed", "on_late", "late_after_ms", "webhook",
                                       "secret")}
    insert = postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert
    stmt = insert(alerts).values(task_type=values["task_type"], created_at=now_ms,
                                 updated_at=now_ms, checked_until=now_ms, events=0, **settings)
    conn.execute(stmt.on_conflict_do_update(index_elements=["task_type"],
                                            set_={**settings, "updated_at": now_ms}))


def secret_of(conn: Connection, task_type: str) -> str | None:
    """The signing secret of the alert of ``task_type`` (None: no such alert)."""
    found: str | None = conn.execute(select(alerts.c.secret).where(
        alerts.c.task_type == task_type)).scalar_one_or_none()
    return found


def remove(conn: Connection, task_type: str) -> bool:
    """Delete the alert of ``task_type``; False if there was none."""
    return conn.execute(delete(alerts).where(alerts.c.task_type == task_type)).rowcount == 1


def list_all(conn: Connection) -> list[dict[str, Any]]:
    """Every alert row, by task type."""
    rows = conn.execute(select(alerts).order_by(alerts.c.task_type))
    return [dict(r._mapping) for r in rows]


def advance(conn: Connection, task_type: str, read_until: int, changes: dict[str, Any],
            read_outbox: str | None = None) -> bool:
    """Apply ``changes`` (which set ``checked_until`` forward) to the alert of
    ``task_type`` if its ``checked_until`` is still ``read_until`` (and, when ``changes``
    write the ``outbox``, that is still ``read_outbox``); True if this call won."""
    stmt = update(alerts).where(alerts.c.task_type == task_type,
                                alerts.c.checked_until == read_until)
    if "outbox" in changes:
        stmt = stmt.where(alerts.c.outbox.is_not_distinct_from(read_outbox))
    return conn.execute(stmt.values(**changes)).rowcount == 1


# -- the outbox: messages not yet delivered (migration 0026) ----------------------------------

def outbox_of(text_: str | None) -> list[dict[str, Any]]:
    """The messages of an ``outbox`` column (``[]``: none)."""
    found: list[dict[str, Any]] = json.loads(text_) if text_ else []
    return found


def outbox_text(entries: list[dict[str, Any]]) -> str | None:
    """``entries`` as the ``outbox`` column (None: none)."""
    return json.dumps(entries, separators=(",", ":")) if entries else None


def take_over_outbox(conn: Connection, task_type: str, read_until: int | None,
                     read_outbox: str | None, outbox: str | None, until_ms: int) -> bool:
    """Take the outbox of ``task_type`` over (its takeover time now ``until_ms``, its
    messages ``outbox``) if its takeover time and messages are still what the caller
    read."""
    stmt = (update(alerts).where(
        alerts.c.task_type == task_type,
        alerts.c.outbox_claimed_until.is_not_distinct_from(read_until),
        alerts.c.outbox.is_not_distinct_from(read_outbox))
        .values(outbox=outbox, outbox_claimed_until=until_ms))
    return conn.execute(stmt).rowcount == 1


def push_back_outbox(conn: Connection, task_type: str, mine: int, until_ms: int | None
                     ) -> bool:
    """Move the outbox takeover time of ``task_type`` from ``mine`` (the caller wrote it)
    to ``until_ms`` (None: now); False if another scheduler has taken the outbox over."""
    stmt = (update(alerts).where(alerts.c.task_type == task_type,
                                 alerts.c.outbox_claimed_until == mine)
            .values(outbox_claimed_until=until_ms))
    return conn.execute(stmt).rowcount == 1


#: tries of :func:`take_out` against concurrent writers of the same outbox
_TAKE_OUT_TRIES = 5


def take_out(conn: Connection, task_type: str, message_id: str) -> bool:
    """Remove the message ``message_id`` from the outbox of ``task_type`` (a
    compare-and-set on the outbox, tried again if another write came between); False if
    it was not there (delivered and taken out already, or the alert is gone)."""
    column = alerts.c.outbox
    for _ in range(_TAKE_OUT_TRIES):
        read = conn.execute(select(column).where(alerts.c.task_type == task_type)).first()
        if read is None:
            return False
        entries = outbox_of(read[0])
        left = [e for e in entries if e.get("id") != message_id]
        if len(left) == len(entries):
            return False
        stmt = (update(alerts).where(alerts.c.task_type == task_type,
                                     column.is_not_distinct_from(read[0]))
                .values(outbox=outbox_text(left)))
        if conn.execute(stmt).rowcount == 1:
            return True
    return False
