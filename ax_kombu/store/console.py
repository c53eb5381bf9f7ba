"""The operator console's reads (:mod:`ax_kombu.web`) that the admin CLI does not make.

Each is one statement served by an index; none reads the whole table, so a page costs
the same with 10 thousand tasks as with 1 million (``bench/web_pages.py``;
docs/benchmarks.md, "Issue 23: ``ax web`` pages with 1,000,000 tasks"):

* :func:`search_tasks` — a keyset page, newest first by ``task_id``. Task ids are
  snowflakes (:mod:`ax_kombu.core.ids`): ordered by creation time, so "newest first"
  and "created between" are ranges of the primary key, and the next page starts below
  the last id shown (never ``OFFSET``).
* :func:`started_since` — (due, started) pairs of the tasks due in a window, newest
  first, at most ``most`` per status, from the ``(status, trigger_time)`` index.
* :func:`running_by_type` — DISPATCHING or RUNNING tasks per type, from the
  ``(task_type, status)`` index.
* :func:`tasks_by_status` — the ``ax status`` count: exact up to :data:`EXACT_UP_TO` per
  status (each count stops there, on the ``(status, trigger_time)`` or ``(task_type,
  status)`` index), estimated above it from PostgreSQL's statistics (``reltuples`` and
  the status column's frequencies, as ``ANALYZE`` left them), so the count costs the same
  with 10 thousand finished tasks as with 10 million.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Row, func, literal, select, text, union_all

from ax_kombu.core.ids import compose
from ax_kombu.core.states import Status
from ax_kombu.store.admin import check_count
from ax_kombu.store.schema import tasks

#: the most tasks one page lists
PAGE_MAX = 200
#: the statuses of a task that has started (its row holds ``started_at``)
STARTED = (Status.RUNNING, Status.SUCCESS, Status.FAILED, Status.CANCELLED)
BUSY = (Status.DISPATCHING, Status.RUNNING)

_LISTED = (tasks.c.task_id, tasks.c.task_type, tasks.c.status, tasks.c.priority,
           tasks.c.trigger_time, tasks.c.attempt, tasks.c.retry_count, tasks.c.biz_key,
           tasks.c.owner_node, tasks.c.created_at, tasks.c.finished_at, tasks.c.last_error)


@dataclass(frozen=True)
class TaskSearch:
    """Which tasks a console page lists: every field given must match."""

    task_id: int | None = None
    biz_key: str | None = None
    task_type: str | None = None
    status: Status | None = None
    #: created in ``[created_from_ms, created_to_ms)``, epoch ms (a range of task ids)
    created_from_ms: int | None = None
    created_to_ms: int | None = None
    #: the keyset cursor: only tasks with a smaller id (the last one of the page before)
    before_id: int | None = None
    limit: int = 50

    def __post_init__(self) -> None:
        check_count("limit", self.limit, PAGE_MAX)


def search_tasks(conn: Connection, wanted: TaskSearch) -> list[Row[Any]]:
    """One page of the tasks ``wanted`` selects, newest (highest id) first.

    Returns:
        Rows with the columns ``task_id, task_type, status, priority, trigger_time,
        attempt, retry_count, biz_key, owner_node, created_at, finished_at,
        last_error``; the next page is ``before_id=`` the last one's id.
    """
    stmt = (select(*_LISTED).where(*_conditions(wanted))
            .order_by(tasks.c.task_id.desc()).limit(wanted.limit))
    return list(conn.execute(stmt))


def _conditions(wanted: TaskSearch) -> list[Any]:
    found: list[Any] = []
    if wanted.task_id is not None:
        found.append(tasks.c.task_id == wanted.task_id)
    if wanted.biz_key is not None:
        found.append(tasks.c.biz_key == wanted.biz_key)
    if wanted.task_type is not None:
        found.append(tasks.c.task_type == wanted.task_type)
    if wanted.status is not None:
        found.append(tasks.c.status == str(wanted.status))
    if wanted.created_from_ms is not None:
        found.append(tasks.c.task_id >= compose(wanted.created_from_ms, 0, 0))
    if wanted.created_to_ms is not None:
        found.append(tasks.c.task_id < compose(wanted.created_to_ms, 0, 0))
    if wanted.before_id is not None:
        found.append(tasks.c.task_id < wanted.before_id)
    return found


def started_since(conn: Connection, since_ms: int, until_ms: int,
                  most: int) -> list[tuple[int, int]]:
    """``(trigger_time, started_at)`` of the started tasks due in ``[since_ms, until_ms]``:
    per status in :data:`STARTED` the ``most`` due last (one index range each, in one
    round trip). A task retried since keeps only its latest attempt's times."""
    parts = [select(tasks.c.trigger_time, tasks.c.started_at)
             .where(tasks.c.status == str(status), tasks.c.trigger_time >= since_ms,
                    tasks.c.trigger_time <= until_ms, tasks.c.started_at.is_not(None))
             .order_by(tasks.c.trigger_time.desc()).limit(most)
             for status in STARTED]
    both = union_all(*(select(p.subquery()) for p in parts))
    return [(int(r[0]), int(r[1])) for r in conn.execute(both)]


def running_by_type(conn: Connection, task_types: Collection[str]) -> dict[str, int]:
    """How many tasks of each of ``task_types`` are DISPATCHING or RUNNING now."""
    if not task_types:
        return {}
    rows = conn.execute(select(tasks.c.task_type, func.count())
                        .where(tasks.c.task_type.in_(list(task_types)),
                               tasks.c.status.in_([str(s) for s in BUSY]))
                        .group_by(tasks.c.task_type))
    found = dict.fromkeys(task_types, 0)
    found.update({r[0]: int(r[1]) for r in rows})
    return found


#: a status with more tasks than this is counted approximately (see task_counts)
EXACT_UP_TO = 1000

_STATUS_STATS = text(
    "SELECT c.reltuples, s.most_common_vals::text::text[], s.most_common_freqs "
    "FROM pg_class c LEFT JOIN pg_stats s ON s.schemaname = current_schema() "
    "AND s.tablename = 'ax_task' AND s.attname = 'status' "
    "WHERE c.oid = to_regclass('ax_task')")


def tasks_by_status(conn: Connection) -> dict[str, int]:
    """Every status with its number of tasks (0 included); see :func:`task_counts`."""
    return task_counts(conn)[0]


def task_counts(conn: Connection, exact_up_to: int = EXACT_UP_TO
                ) -> tuple[dict[str, int], set[str]]:
    """Every status with its number of tasks, and the statuses whose number is estimated.

    On PostgreSQL each status is counted up to ``exact_up_to`` (an index range that stops
    there); one with more is estimated from the planner's statistics (the table's row
    estimate times the status's share), never below ``exact_up_to + 1``. The waiting and
    running counts that an operator acts on are small and exact; millions of finished
    tasks are not counted one by one. SQLite (one embedded process) counts exactly.
    """
    found = {str(s): 0 for s in Status}
    if conn.dialect.name != "postgresql":
        rows = conn.execute(select(tasks.c.status, func.count()).group_by(tasks.c.status))
        found.update({r[0]: int(r[1]) for r in rows})
        return found, set()
    capped = union_all(*[
        select(literal(str(s)).label("status"),
               select(func.count()).select_from(
                   select(literal(1)).where(tasks.c.status == str(s))
                   .limit(exact_up_to + 1).subquery()).scalar_subquery().label("n"))
        for s in Status])
    found.update({r.status: int(r.n) for r in conn.execute(capped)})
    over = {s for s, n in found.items() if n > exact_up_to}
    if over:
        stats = conn.execute(_STATUS_STATS).first()
        share: dict[str, float] = {}
        if stats is not None and stats[1] is not None:
            share = dict(zip(stats[1], map(float, stats[2]), strict=False))
        in_table = max(0.0, float(stats[0])) if stats is not None else 0.0
        for status in over:
            found[status] = max(exact_up_to + 1, round(in_table * share.get(status, 0.0)))
    return found, over
