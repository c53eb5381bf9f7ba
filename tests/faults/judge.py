"""The judge: after the load, wait (poll, deadline, early exit when nothing moves) until
every task is final, then compute a :class:`~tests.faults.verdict.Verdict` from the
ledger and the table.

Every verdict is kept in :data:`RESULTS` for the session's summary table
(:func:`tests.faults.verdict.table`, printed by the suite's ``conftest``).
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..ledger import Run
from .cluster import Cluster
from .producer import Planned
from .timing import now_ms
from .verdict import Verdict

FINAL = ("SUCCESS", "FAILED", "CANCELLED")
#: how early a start may look because two clocks (worker, database) were read (ms)
EARLY_TOLERANCE_MS = 10

#: every verdict of the session, for the summary table
RESULTS: list[Verdict] = []


def settle(cluster: Cluster, ids: Sequence[int], last_trigger: int, *, deadline_s: float = 25.0,
           stall_s: float = 8.0) -> float:
    """Wait until every task in ``ids`` is final and no run of a live process is still open.

    Gives up ``deadline_s`` after ``last_trigger``, or once nothing changed (statuses,
    ledger) for ``stall_s`` after the last trigger time passed. Returns the seconds waited.
    """
    t0 = time.monotonic()
    hard = time.monotonic() + max(0.0, (last_trigger - now_ms()) / 1000) + deadline_s
    wanted = set(ids)
    last_state: tuple[Any, ...] | None = None
    last_change = time.monotonic()
    while time.monotonic() < hard:
        rows = cluster.task_rows()
        statuses = Counter(rows[i].status if i in rows else "MISSING" for i in wanted)
        live = cluster.running_pids()
        runs = cluster.ledger.runs()
        open_runs = sum(1 for r in runs if r.end is None and r.pid in live)
        if sum(statuses[s] for s in FINAL) == len(wanted) and not open_runs:
            time.sleep(0.5)  # a last look for a late duplicate start
            return time.monotonic() - t0
        state = (tuple(sorted(statuses.items())), len(runs), open_runs)
        if state != last_state:
            last_state, last_change = state, time.monotonic()
        elif now_ms() > last_trigger and time.monotonic() - last_change > stall_s:
            break
        time.sleep(0.25)
    return time.monotonic() - t0


def judge(cluster: Cluster, fault: str, planned: Sequence[Planned], *, fault_start: int,
          fault_end: int, expect_failed: Iterable[int] = (), retried_by_design: Iterable[int] = (),
          deadline_s: float = 25.0, stall_s: float = 6.0) -> Verdict:
    """Wait for the tasks to settle (see :func:`settle`), then judge them.

    Args:
        planned: the tasks (as the producers enqueued them).
        fault_start, fault_end: the fault window (epoch ms); tasks planned inside it are
            "during", later ones "after"; tasks *enqueued* after ``fault_end`` are the
            "later tasks" that must run exactly once.
        expect_failed: tasks meant to end FAILED (not lost when they do).
        retried_by_design: tasks whose several runs are retries (not "ran twice"; two
            runs of them at once still count as overlapping).
    """
    ids = [p.task_id for p in planned]
    waited = settle(cluster, ids, max(p.trigger for p in planned), deadline_s=deadline_s,
                    stall_s=stall_s)
    rows = cluster.task_rows()
    by_task = cluster.ledger.by_task()
    corrupt = list(cluster.ledger.corrupt)
    retried_by_design = set(retried_by_design)

    lost, never_ran, stuck, why_lost = _endings(ids, rows, by_task, set(expect_failed))
    runs = _runs(cluster, ids, by_task, set(retried_by_design))

    def late(select: Callable[[Planned], bool]) -> int | None:
        values = [by_task[p.task_id][0].start - p.trigger for p in planned
                  if select(p) and p.task_id in by_task]
        return max(values) if values else None

    later = [p.task_id for p in planned if p.enqueued >= fault_end]
    later_not_once = {t: len(by_task.get(t, [])) for t in later
                      if len(by_task.get(t, [])) != 1 and t not in retried_by_design}
    return Verdict(
        fault=fault, tasks=len(ids), lost=lost, never_ran=never_ran, stuck=stuck,
        ran_twice=runs.ran_twice, ran_twice_dead_pid=runs.dead_pid,
        published_twice=runs.published_twice, early=runs.early, late_before_ms=late(lambda p: p.trigger < fault_start),
        late_during_ms=late(lambda p: fault_start <= p.trigger <= fault_end),
        late_after_ms=late(lambda p: p.trigger > fault_end), later=len(later),
        later_not_once=later_not_once, overlapping=runs.overlapping, settled_s=waited,
        extra={"lost by status (last_error)": dict(why_lost)} if why_lost else {},
        notes=[f"{len(corrupt)} unreadable ledger lines, e.g. {corrupt[:2]}"] if corrupt else [],
        ledger_corrupt=len(corrupt))


def _endings(ids: Sequence[int], rows: dict[int, Any], by_task: dict[int, list[Run]],
             expect_failed: set[int]) -> tuple[list[int], list[int], Counter[str], Counter[str]]:
    """How the tasks ended: lost (not SUCCESS, unless meant to fail), never ran, stuck
    (not final, by status), and why the lost were lost."""
    lost, never_ran, stuck, why_lost = [], [], Counter[str](), Counter[str]()
    for task_id in ids:
        row = rows.get(task_id)
        status = row.status if row is not None else "MISSING"
        if status not in FINAL:
            stuck[status] += 1
        if status != "SUCCESS" and not (task_id in expect_failed and status == "FAILED"):
            lost.append(task_id)
            why_lost[f"{status}" + (f" ({row.last_error})" if row is not None
                                    and row.last_error else "")] += 1
        if task_id not in by_task:
            never_ran.append(task_id)
    return lost, never_ran, stuck, why_lost


@dataclass
class _RunFindings:
    ran_twice: dict[int, list[Run]] = field(default_factory=dict)
    dead_pid: set[int] = field(default_factory=set)
    published_twice: list[tuple[int, int]] = field(default_factory=list)
    overlapping: dict[int, list[Run]] = field(default_factory=dict)
    early: dict[int, int] = field(default_factory=dict)


def _runs(cluster: Cluster, ids: Sequence[int], by_task: dict[int, list[Run]],
          retried_by_design: set[int]) -> _RunFindings:
    """What the ledger says of each task's runs: twice, twice for one attempt, at once, early."""
    found = _RunFindings()
    for task_id in ids:
        runs = by_task.get(task_id, [])
        attempts = Counter(r.attempt for r in runs)
        found.published_twice += [(task_id, a) for a, n in attempts.items() if n > 1]
        if len(runs) > 1 and task_id not in retried_by_design:
            found.ran_twice[task_id] = runs
            if task_id in cluster.running_at_kill or any(
                    r.end is None and r.pid in cluster.killed for r in runs):
                found.dead_pid.add(task_id)
        for a, b in itertools.pairwise(runs):
            if (a.end is None and a.pid not in cluster.killed) or (a.end or 0) > b.start:
                found.overlapping[task_id] = runs
        for r in runs:
            if r.start < r.trigger - EARLY_TOLERANCE_MS:
                found.early[task_id] = max(found.early.get(task_id, 0), r.trigger - r.start)
    return found


def record(verdict: Verdict) -> Verdict:
    """Keep ``verdict`` for the summary table, and print it."""
    RESULTS.append(verdict)
    print("\n" + verdict.describe())
    return verdict


def conclude(cluster: Cluster, verdict: Verdict, **invariants: Any) -> None:
    """Record the verdict, then fail the test with every broken invariant (and log tails)."""
    record(verdict)
    problems = verdict.problems(**invariants)
    assert not problems, ("; ".join(problems) + "\n" + verdict.describe() + "\n"
                          + cluster.tails(15))

