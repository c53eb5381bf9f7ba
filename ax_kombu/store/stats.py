"""Run-time statistics from the attempt history, for ``ax plan --from-history``.

The history is the ``ax_attempt`` rows (attempts that did not end their task) and the
finished task rows (each one's final attempt, see :mod:`ax_kombu.store.schema`): one
bounded read of both, the durations of the most recent :data:`MAX_RUNS` runs of a type
that started and finished at or after a time. The
average and the percentiles are computed here in Python from those durations, so the same
statement serves PostgreSQL and SQLite (neither's percentile functions are needed).
Attempts that never started (``duration_ms`` NULL: lost or unacknowledged before a worker
took them) are not runs and are left out; every outcome of a run counts (a failed run took
a thread for as long as a successful one). A negative duration (the clocks that stamped its
start and end disagreeing) counts as 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Connection, select, union_all

from ax_kombu.core.planning import percentile
from ax_kombu.store.schema import attempts, tasks

#: the most recent runs read; a larger history is sampled by its newest end
MAX_RUNS = 100_000


@dataclass(frozen=True)
class RunTimes:
    """How long the runs of one task type took (milliseconds)."""

    task_type: str
    #: runs measured (at most MAX_RUNS)
    runs: int
    avg_ms: float
    p50_ms: int
    p99_ms: int


@dataclass(frozen=True)
class Delays:
    """Schedule delay (dispatched − trigger time) of recent dispatches, milliseconds."""

    dispatches: int
    p50_ms: int
    p99_ms: int


_DISPATCHED = ("DISPATCHING", "RUNNING", "SUCCESS", "FAILED", "CANCELLED")


def schedule_delays(conn: Connection, since_ms: int) -> Delays | None:
    """The schedule delay of tasks due since ``since_ms`` and dispatched (their latest
    attempt); at most :data:`MAX_RUNS`, newest first. None: nothing was dispatched.

    One ordered read per status, merged: on PostgreSQL the in-flight states and the
    finished ones are in different partial indexes (:mod:`ax_kombu.store.schema`), and
    no one index serves an ``IN`` list that spans both."""
    parts = [select((tasks.c.dispatched_at - tasks.c.trigger_time).label("d"),
                    tasks.c.trigger_time.label("t"))
             .where(tasks.c.status == status, tasks.c.trigger_time >= since_ms,
                    tasks.c.dispatched_at.is_not(None))
             .order_by(tasks.c.trigger_time.desc()).limit(MAX_RUNS)
             for status in _DISPATCHED]
    both = union_all(*(select(p.subquery()) for p in parts)).subquery()
    query = select(both.c.d).order_by(both.c.t.desc()).limit(MAX_RUNS)
    delays = sorted(max(0, int(d)) for d in conn.execute(query).scalars())
    if not delays:
        return None
    return Delays(len(delays), percentile(delays, 50), percentile(delays, 99))


def run_times(conn: Connection, task_type: str, since_ms: int) -> RunTimes | None:
    """The run times of ``task_type`` over its runs that finished at or after ``since_ms``.

    Args:
        conn: a connection to the store.
        task_type: the task type.
        since_ms: epoch ms (database clock); older runs are not read.

    Returns:
        The statistics of the newest :data:`MAX_RUNS` such runs, or None if there are none.
    """
    earlier = (select(attempts.c.duration_ms.label("d"), attempts.c.finished_at.label("f"))
               .where(attempts.c.task_type == task_type, attempts.c.finished_at >= since_ms,
                      attempts.c.duration_ms.is_not(None)))
    final = (select((tasks.c.finished_at - tasks.c.started_at).label("d"),
                    tasks.c.finished_at.label("f"))
             .where(tasks.c.task_type == task_type,
                    tasks.c.status.in_(["SUCCESS", "FAILED", "CANCELLED"]),
                    tasks.c.finished_at >= since_ms, tasks.c.started_at.is_not(None)))
    runs = union_all(earlier, final).subquery()
    query = select(runs.c.d).order_by(runs.c.f.desc()).limit(MAX_RUNS)
    durations = sorted(max(0, int(d)) for d in conn.execute(query).scalars())
    if not durations:
        return None
    return RunTimes(task_type=task_type, runs=len(durations),
                    avg_ms=sum(durations) / len(durations),
                    p50_ms=percentile(durations, 50), p99_ms=percentile(durations, 99))
