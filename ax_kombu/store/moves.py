"""Moving and cancelling tasks that have not run: by id or by ``(task_type, biz_key)``.

Each move is one compare-and-set on the row, and its rowcount decides:

* **Move** (``reschedule``, ``run_now``, a replacing enqueue): ``UPDATE … SET trigger_time
  … WHERE task_id = … AND status IN ('CREATED', 'DELAYED', 'READY') AND attempt = … AND
  trigger_time = …`` (the values read just before). A scheduler claims with its own
  compare-and-set on the status and the trigger time (:mod:`ax_kombu.store.claims`), so the
  two exclude each other on the row: either the move commits first, and the claim no
  longer finds the task due at the old time (a wheel that still has the old time loaded claims
  nothing), or the claim does, and the move finds the task DISPATCHING and reports it.
  **No window exists in which both times run.** A task claimed or staged for its start
  (DISPATCHING, or RUNNING and staged on a worker until its trigger time) is not moved: the
  caller learns it (:class:`~ax_kombu.exceptions.TooLateToMove`). The new time reaches the
  schedulers as any new task's does: ``ax_due`` gets its entry from the database's trigger,
  and a time inside the preload window wakes them (NOTIFY, at the commit).
* **Cancel**: ``… SET status = 'CANCELLED' WHERE … AND status IN (the non-final
  states)``; a staged or running task's worker sees it within its cancel check (50 ms).

Every move writes an ``ax_move`` row in the same transaction (the task's history).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from sqlalchemy import Connection, Row, case, insert, literal, select, update

from ax_kombu.core import states
from ax_kombu.core.states import Status, check
from ax_kombu.exceptions import IllegalTransition, TaskNotFound, TooLateToMove, ValidationError
from ax_kombu.store.schema import fingerprints, moves, tasks
from ax_kombu.store.tasks import forget_fingerprints, wake_schedulers
from ax_kombu.store.waits import notify_ended

_PENDING = [str(s) for s in states.CLAIMABLE]
_ACTIVE = sorted(str(s) for s in states.ACTIVE)


@dataclass(frozen=True)
class Target:
    """Which task a call means: its id, or its ``(task_type, biz_key)``."""

    task_id: int | None = None
    task_type: str | None = None
    biz_key: str | None = None

    def __post_init__(self) -> None:
        if self.task_id is not None and (self.task_type is not None or self.biz_key is not None):
            raise ValidationError("give a task_id or a task_type with a biz_key, not both")
        if self.task_id is None and (self.task_type is None or self.biz_key is None):
            raise ValidationError("give a task_id, or both task_type and biz_key")
        if self.task_id is not None and (isinstance(self.task_id, bool)
                                         or not isinstance(self.task_id, int)):
            raise ValidationError(f"task_id must be an int, got {type(self.task_id).__name__}")

    def where(self) -> Any:
        """The SQL condition that selects the task (the primary key, or the unique
        ``(task_type, biz_key)`` index)."""
        if self.task_id is not None:
            return tasks.c.task_id == int(self.task_id)
        return (tasks.c.task_type == self.task_type) & (tasks.c.biz_key == self.biz_key)

    def __str__(self) -> str:
        if self.task_id is not None:
            return f"task {self.task_id}"
        return f"task {self.task_type!r} with biz_key {self.biz_key!r}"


_READ = select(tasks.c.task_id, tasks.c.status, tasks.c.trigger_time, tasks.c.attempt,
               tasks.c.task_type)


def find(conn: Connection, target: Target) -> Row[Any]:
    """The task's id, status, trigger time, attempt and type.

    Raises:
        TaskNotFound: no such task.
    """
    row = cast("Row[Any] | None", conn.execute(_READ.where(target.where())).first())
    if row is None:
        raise TaskNotFound(f"no {target}")
    return row


@dataclass(frozen=True)
class Change:
    """What a move sets: the new trigger time and, optionally, a new payload (canonical
    JSON, with its fingerprint)."""

    to_time: int
    kind: str
    payload: str | None = None
    fingerprint: str | None = None


def move(conn: Connection, target: Target, change: Change, now_ms: int,
         wake_before_ms: int) -> tuple[int, int]:
    """Give a pending task a new trigger time (and payload): one compare-and-set.

    Returns:
        ``(task_id, from_time)``.
    Raises:
        TaskNotFound: no such task.
        TooLateToMove: it is claimed, staged for its start, or running.
        IllegalTransition: it has finished.
    """
    row = find(conn, target)
    if row.status not in _PENDING:
        raise refusal(row, now_ms)
    status = Status.DELAYED if change.to_time > now_ms else Status.READY
    check([row.status], status)
    values: dict[str, Any] = {
        "trigger_time": change.to_time,
        "status": str(status),
        # a task of an order_key keeps its place by order_seq, its first trigger time; a
        # moved one takes the new time's place
        "order_seq": case((tasks.c.order_key.is_(None), tasks.c.order_seq),
                          else_=literal(change.to_time)),
    }
    if change.payload is not None:
        values.update(payload=change.payload, fingerprint=change.fingerprint)
    stmt = (update(tasks).values(**values)
            .where(tasks.c.task_id == row.task_id, tasks.c.status.in_(_PENDING),
                   tasks.c.attempt == row.attempt, tasks.c.trigger_time == row.trigger_time))
    if conn.execute(stmt).rowcount != 1:
        raise refusal(find(conn, target), now_ms)  # it moved meanwhile: say what it is now
    record(conn, [(row.task_id, row.trigger_time, change.to_time, row.attempt)], change.kind,
           now_ms)
    if change.fingerprint is not None:
        refingerprint(conn, row.task_id, change.fingerprint, change.to_time)
    if change.to_time < wake_before_ms:
        wake_schedulers(conn, change.to_time)
    return row.task_id, row.trigger_time


def record(conn: Connection, moved: Sequence[tuple[int, int, int, int]], kind: str,
           now_ms: int) -> None:
    """Write the ``ax_move`` rows of ``moved``: ``(task_id, from_time, to_time, attempt)``."""
    if moved:
        conn.execute(insert(moves), [{"task_id": t, "from_time": f, "to_time": to,
                                      "attempt": a, "kind": kind, "moved_at": now_ms}
                                     for t, f, to, a in moved])


def refingerprint(conn: Connection, task_id: int, fingerprint: str, trigger_ms: int) -> None:
    """The task's duplicate-check entry, for its new payload and time (the old one goes)."""
    old = conn.execute(select(fingerprints.c.fingerprint)
                       .where(fingerprints.c.task_id == task_id)).scalars().all()
    forget_fingerprints(conn, [(task_id, fp) for fp in old])
    conn.execute(insert(fingerprints), [{"fingerprint": fingerprint, "trigger_time": trigger_ms,
                                         "task_id": task_id}])


def refusal(row: Row[Any], now_ms: int) -> Exception:
    """Why the task ``row`` cannot be moved, as the exception to raise."""
    status = Status(row.status)
    if status in states.FINAL:
        return IllegalTransition(f"task {row.task_id} is {status}; only a task that has not "
                                 "started can be moved")
    if row.trigger_time > now_ms:
        return TooLateToMove(f"task {row.task_id} is {status}: staged for its start at its "
                             f"trigger time ({row.trigger_time - now_ms} ms from now), too "
                             "close to its start to move; cancel it instead")
    return TooLateToMove(f"task {row.task_id} has already started ({status})")


def moves_of(conn: Connection, task_id: int) -> list[dict[str, Any]]:
    """The task's moves, oldest first."""
    return [dict(r._mapping) for r in conn.execute(
        select(moves).where(moves.c.task_id == task_id).order_by(moves.c.moved_at))]


def forget_moves(conn: Connection, task_ids: Sequence[int]) -> None:
    """Delete the moves of tasks leaving ``ax_task`` (archive, purge)."""
    if task_ids:
        conn.execute(moves.delete().where(moves.c.task_id.in_(list(task_ids))))


def cancel(conn: Connection, target: Target, now_ms: int) -> int | None:
    """Cancel the task if it has not finished: its id, or None if it had (or there is no
    such task: :func:`find` tells which). Announced to waiters
    (:func:`~ax_kombu.store.waits.notify_ended`)."""
    stmt = (update(tasks).where(target.where(), tasks.c.status.in_(_ACTIVE))
            .values(status=str(Status.CANCELLED), finished_at=now_ms)
            .returning(tasks.c.task_id))
    task_id: int | None = conn.execute(stmt).scalar()
    if task_id is not None:
        notify_ended(conn, [task_id])
    return task_id


@dataclass(frozen=True)
class Selection:
    """Which tasks ``cancel_many`` cancels: every field given must match."""

    task_type: str | None = None
    statuses: tuple[str, ...] = tuple(_ACTIVE)
    biz_keys: tuple[str, ...] | None = None
    #: created at or after this (epoch ms, DB clock)
    created_from: int | None = None

    def where(self) -> list[Any]:
        found: list[Any] = [tasks.c.status.in_(list(self.statuses))]
        if self.task_type is not None:
            found.append(tasks.c.task_type == self.task_type)
        if self.biz_keys is not None:
            found.append(tasks.c.biz_key.in_(list(self.biz_keys)))
        if self.created_from is not None:
            found.append(tasks.c.created_at >= self.created_from)
        return found


def cancel_some(conn: Connection, selection: Selection, now_ms: int, batch: int) -> int:
    """Cancel up to ``batch`` tasks of ``selection``; returns how many. (The outer
    statement repeats the conditions: a task that moved on since the inner select is left
    alone.) Announced to waiters (:func:`~ax_kombu.store.waits.notify_ended`)."""
    chosen = select(tasks.c.task_id).where(*selection.where()).limit(batch)
    stmt = (update(tasks).where(tasks.c.task_id.in_(chosen), *selection.where())
            .values(status=str(Status.CANCELLED), finished_at=now_ms)
            .returning(tasks.c.task_id))
    cancelled = list(conn.execute(stmt).scalars())
    notify_ended(conn, cancelled)
    return len(cancelled)
