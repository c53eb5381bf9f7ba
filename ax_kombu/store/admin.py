"""The operator's SQL: list tasks, retry failed or cancelled ones, purge finished history.

Guarantees, on PostgreSQL and SQLite alike:

* :func:`list_tasks` is one read; newest first (``created_at``, then ``task_id``).
* :func:`retry_tasks` is one compare-and-set ``UPDATE`` per batch
  (:func:`ax_kombu.store.transitions.transition`, FAILED | CANCELLED → READY): a task
  that meanwhile left FAILED or CANCELLED does not move. A retried task is due at
  once, loaded by no scheduler, keeps its ``retry_count`` and ``last_error``; its
  ``ax_attempt`` rows stay, so the history shows the earlier attempts. Schedulers
  are woken in the same transaction (on commit).
* :func:`purge_finished` deletes in short transactions of at most ``batch`` tasks
  each, the tasks first (``DELETE … RETURNING``), then the ``ax_attempt`` rows of
  exactly the tasks deleted, so no lock is kept long and a task retried meanwhile
  keeps its history.

Every function here raises :class:`~ax_kombu.exceptions.StoreError` when the
database fails, and :class:`~ax_kombu.exceptions.ValidationError` on bad input.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine, Row, bindparam, delete, func, select
from sqlalchemy.exc import SQLAlchemyError

from ax_kombu.core.states import FINAL, S, Status
from ax_kombu.exceptions import StoreError, ValidationError
from ax_kombu.observability.redaction import redact_url
from ax_kombu.store.engine import db_now_ms
from ax_kombu.store.moves import forget_moves
from ax_kombu.store.run_logs import delete_logs
from ax_kombu.store.schema import attempts, tasks
from ax_kombu.store.tasks import forget_fingerprints, keep_final_attempts, wake_schedulers
from ax_kombu.store.transitions import transition

#: ``ax list --limit``: the default and the most one call returns
LIST_DEFAULT, LIST_MAX = 50, 10_000
#: the most ids one retry or purge statement names (SQLite allows 32,766 parameters)
BATCH_MAX = 10_000
RETRYABLE = (S.FAILED, S.CANCELLED)

T = TypeVar("T")


def parse_status(text: str, allowed: Sequence[Status] = tuple(Status)) -> Status:
    """``text`` (any case) as a status among ``allowed``.

    Raises:
        ValidationError: it is not one of them; the message names the valid ones.
    """
    value = text.strip().upper()
    if value not in allowed:
        valid = ", ".join(s for s in Status if s in allowed)
        raise ValidationError(f"status must be one of {valid}, not {text!r}")
    return Status(value)


def check_count(name: str, value: int, most: int | None = None) -> int:
    """``value`` if it is at least 1 (and at most ``most``).

    Raises:
        ValidationError: it is not.
    """
    if value < 1 or (most is not None and value > most):
        bounds = f"between 1 and {most}" if most is not None else "at least 1"
        raise ValidationError(f"{name} must be {bounds}, not {value}")
    return value


def _guarded(engine: Engine, work: Callable[[], T]) -> T:
    try:
        return work()
    except SQLAlchemyError as exc:
        raise StoreError(f"the store {redact_url(str(engine.url))} failed: "
                         f"{type(exc).__name__}") from None


# -- list ----------------------------------------------------------------------------------------

_LISTED = (tasks.c.task_id, tasks.c.task_type, tasks.c.status, tasks.c.trigger_time,
           tasks.c.attempt, tasks.c.retry_count, tasks.c.owner_node, tasks.c.last_error,
           tasks.c.biz_key, tasks.c.created_at, tasks.c.finished_at)


@dataclass(frozen=True)
class TaskFilter:
    """Which tasks ``ax list`` shows: every field given must match."""

    status: Status | None = None
    task_type: str | None = None
    biz_key: str | None = None
    #: created at most this many ms ago
    since_ms: int | None = None
    limit: int = LIST_DEFAULT

    def __post_init__(self) -> None:
        check_count("--limit", self.limit, LIST_MAX)
        if self.since_ms is not None and self.since_ms < 0:
            raise ValidationError(f"--since must not be negative, not {self.since_ms} ms")


def list_tasks(engine: Engine, wanted: TaskFilter) -> list[Row[Any]]:
    """The tasks ``wanted`` selects, newest first (``created_at``, then ``task_id``).

    Returns:
        Rows with the columns ``task_id, task_type, status, trigger_time, attempt,
        retry_count, owner_node, last_error, biz_key, created_at, finished_at``.
    """
    def read() -> list[Row[Any]]:
        with engine.connect() as conn:
            stmt = (select(*_LISTED).where(*_conditions(conn, wanted))
                    .order_by(tasks.c.created_at.desc(), tasks.c.task_id.desc())
                    .limit(wanted.limit))
            return list(conn.execute(stmt))

    return _guarded(engine, read)


def _conditions(conn: Connection, wanted: TaskFilter) -> list[Any]:
    found: list[Any] = []
    if wanted.status is not None:
        found.append(tasks.c.status == str(wanted.status))
    if wanted.task_type is not None:
        found.append(tasks.c.task_type == wanted.task_type)
    if wanted.biz_key is not None:
        found.append(tasks.c.biz_key == wanted.biz_key)
    if wanted.since_ms is not None:
        found.append(tasks.c.created_at >= db_now_ms(conn) - wanted.since_ms)
    return found


# -- retry ---------------------------------------------------------------------------------------

@dataclass
class Retried:
    """What a retry did: the ids that went back to READY, and why the others did not."""

    retried: list[int] = field(default_factory=list)
    #: task id → its status, or ``"not found"``
    refused: dict[int, str] = field(default_factory=dict)


def retry_tasks(conn: Connection, task_ids: Sequence[int]) -> list[int]:
    """FAILED | CANCELLED → READY, due now, in one compare-and-set statement; wakes schedulers.

    ``trigger_time`` becomes the database's now, ``owner_node``, ``finished_at``
    NULL, ``redispatches`` 0 (a task that failed unstarted gets its full dispatch
    budget again); ``retry_count``, ``last_error`` and the ``ax_attempt`` rows stay.

    Returns:
        The ids that moved (the others were not FAILED or CANCELLED).
    """
    now = db_now_ms(conn)
    keep_final_attempts(conn, task_ids)  # the row is about to start a new attempt
    moved = transition(conn, task_ids, RETRYABLE, S.READY,
                       values={"trigger_time": now, "owner_node": None,
                               "finished_at": None, "redispatches": 0})
    if moved:
        wake_schedulers(conn, now)
    return moved


def retry_ids(engine: Engine, task_ids: Sequence[int]) -> Retried:
    """Retry the given tasks (one transaction per :data:`BATCH_MAX` ids).

    Returns:
        The ids retried, and for each other id its status or ``"not found"``.
    """
    wanted = list(dict.fromkeys(task_ids))

    def run() -> Retried:
        outcome = Retried()
        for start in range(0, len(wanted), BATCH_MAX):
            chunk = wanted[start:start + BATCH_MAX]
            with engine.begin() as conn:
                outcome.retried += retry_tasks(conn, chunk)
                outcome.refused.update(_why_not(conn, chunk, set(outcome.retried)))
        return outcome

    return _guarded(engine, run)


def _why_not(conn: Connection, chunk: Sequence[int], moved: set[int]) -> dict[int, str]:
    rest = [i for i in chunk if i not in moved]
    if not rest:
        return {}
    found = dict(conn.execute(select(tasks.c.task_id, tasks.c.status)
                              .where(tasks.c.task_id.in_(rest))).all())
    return {i: found.get(i, "not found") for i in rest}


def retry_matching(engine: Engine, task_type: str, status: Status, *,
                   since_ms: int | None = None, limit: int | None = None,
                   batch: int = 1000) -> Retried:
    """Retry the ``task_type`` tasks in ``status`` (FAILED or CANCELLED), in task_id order.

    Each batch is one transaction: a read of up to ``batch`` ids after the last
    one seen, then :func:`retry_tasks` on them; a task that fails again meanwhile
    is not retried twice.

    Args:
        since_ms: only tasks that finished (failed, were cancelled) at most this long ago.
        limit: retry at most this many (None: all).
    Raises:
        ValidationError: ``status`` is not FAILED or CANCELLED, or a bad limit or batch.
    """
    parse_status(status, RETRYABLE)
    check_count("--batch", batch, BATCH_MAX)
    if limit is not None:
        check_count("--limit", limit)

    def run() -> Retried:
        outcome, after = Retried(), -1
        while limit is None or len(outcome.retried) < limit:
            size = batch if limit is None else min(batch, limit - len(outcome.retried))
            with engine.begin() as conn:
                ids = _retryable(conn, task_type, status, since_ms, after, size)
                if not ids:
                    break
                outcome.retried += retry_tasks(conn, ids)
            after = ids[-1]
        return outcome

    return _guarded(engine, run)


def _retryable(conn: Connection, task_type: str, status: Status, since_ms: int | None,
               after: int, size: int) -> list[int]:
    stmt = (select(tasks.c.task_id)
            .where(tasks.c.task_type == task_type, tasks.c.status == str(status),
                   tasks.c.task_id > after)
            .order_by(tasks.c.task_id).limit(size))
    if since_ms is not None:
        stmt = stmt.where(tasks.c.finished_at >= db_now_ms(conn) - since_ms)
    return [r[0] for r in conn.execute(stmt)]


# -- purge ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Purged:
    """How many tasks and ``ax_attempt`` rows a purge deleted (or, dry, would delete)."""

    tasks: int
    attempts: int


def purge_finished(engine: Engine, status: Status, older_than_ms: int, *,
                   batch: int = 1000, dry_run: bool = False) -> Purged:
    """Delete the tasks in ``status`` that finished more than ``older_than_ms`` ago, with
    their ``ax_attempt`` and ``ax_run_log`` rows, ``batch`` tasks per transaction.

    Args:
        status: SUCCESS, FAILED or CANCELLED.
        dry_run: count what would go; delete nothing.
    Raises:
        ValidationError: ``status`` is not final, or a bad batch or age.
    """
    parse_status(status, tuple(FINAL))
    check_count("--batch", batch, BATCH_MAX)
    if older_than_ms < 0:
        raise ValidationError(f"--older-than must not be negative, not {older_than_ms} ms")

    def run() -> Purged:
        with engine.connect() as conn:
            cutoff = db_now_ms(conn) - older_than_ms
        if dry_run:
            return _count(engine, status, cutoff)
        return _delete_all(engine, status, cutoff, batch)

    return _guarded(engine, run)


def _old(status: Status, cutoff: int) -> list[Any]:
    return [tasks.c.status == str(status), tasks.c.finished_at < cutoff]


def _count(engine: Engine, status: Status, cutoff: int) -> Purged:
    with engine.connect() as conn:
        old = select(tasks.c.task_id).where(*_old(status, cutoff))
        found = conn.execute(select(func.count()).select_from(old.subquery())).scalar_one()
        history = conn.execute(select(func.count()).select_from(attempts)
                               .where(attempts.c.task_id.in_(old))).scalar_one()
    return Purged(int(found), int(history))


_DELETE_ATTEMPTS = delete(attempts).where(
    attempts.c.task_id.in_(bindparam("ids", expanding=True)))


def _delete_all(engine: Engine, status: Status, cutoff: int, batch: int) -> Purged:
    total_tasks = total_attempts = 0
    while True:
        with engine.begin() as conn:
            ids = _delete_batch(conn, status, cutoff, batch)
            if ids:
                total_attempts += conn.execute(_DELETE_ATTEMPTS, {"ids": ids}).rowcount
                forget_moves(conn, ids)
                delete_logs(conn, ids)  # each run's own log lines go with their task
        total_tasks += len(ids)
        if len(ids) < batch:
            return Purged(total_tasks, total_attempts)


def _delete_batch(conn: Connection, status: Status, cutoff: int, batch: int) -> list[int]:
    """One short ``DELETE … WHERE task_id IN (SELECT … LIMIT batch) RETURNING task_id``.

    The outer statement repeats the test, so a row that changed after the inner
    select (a retry) is left alone.
    """
    chosen = select(tasks.c.task_id).where(*_old(status, cutoff)).limit(batch)
    stmt = (delete(tasks).where(tasks.c.task_id.in_(chosen), *_old(status, cutoff))
            .returning(tasks.c.task_id, tasks.c.fingerprint))
    removed = [(r[0], r[1]) for r in conn.execute(stmt)]
    forget_fingerprints(conn, removed)
    return [r[0] for r in removed]
