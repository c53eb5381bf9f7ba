"""Tasks that move with the business, against a real ``ax-scheduler`` and ``ax-worker``
(PostgreSQL + Redis; each scenario at this one tier), counted from what ran
(:class:`~tests.e2e.system.Ledger`):

* a transaction that stays open and commits late still fires its task at the commit,
  while other producers commit later tasks in between (out-of-order commits), with the
  recovery scan too slow to be what finds it;
* ``reschedule`` racing the claim of a burst within ``claim_lead_ms`` of its due time: a
  task whose move succeeded never runs at its old time; one refused runs at its old time;
* ``cancel`` by business key racing the claim: nothing runs twice, a task cancelled well
  before its time never runs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psycopg2
import pytest

from ax_kombu.api import Client
from ax_kombu.exceptions import IllegalTransition, TooLateToMove

from ..ledger import Ledger
from .system import CLOCK_TOLERANCE_MS, System, pct

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

#: the recovery scan's period here: far beyond every wait below, so only the preload can
#: be what fires a task
SLOW_RECOVERY = {"recovery_interval_s": 60}


@pytest.fixture
def system(pg_url: str, redis_broker: dict[str, str], tmp_path: Path) -> Iterator[System]:
    ax = System(pg_url, redis_broker, tmp_path, env=SLOW_RECOVERY)
    ax.scheduler("sched-0")
    ax.worker("worker-0")
    ax.wait_ready()
    yield ax
    ax.close()


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _task(log: Ledger, i: int, **options: Any) -> dict[str, Any]:
    return {"task_type": "e2e.task", "payload": {"log": str(log), "i": i}, **options}


@pytest.mark.timeout(90)
def test_a_late_commit_fires_at_the_commit_despite_later_commits_in_between(
        system: System, tmp_path: Path) -> None:
    log = Ledger(tmp_path / "runs.jsonl")
    dsn = system.database_url.replace("postgresql+psycopg2://", "postgresql://")
    late = [psycopg2.connect(dsn) for _ in range(3)]
    # no duplicate check: its advisory lock is taken on one of 512 hash buckets, so now and
    # then an enqueue below shared a bucket with an open late transaction, and waited for a
    # commit that this same thread was to make after it (a hang, in CI)
    producer = Client(system.settings.replace(dedup_window_ms=0))
    try:
        # opened first, each enqueues a task due in 0.5 s and stays open 2-4 s
        mine = [producer.enqueue_many([_task(log, 1000 + k, delay=0.5)], connection=c)[0]
                for k, c in enumerate(late)]
        others: list[int] = []
        committed: dict[int, int] = {}
        started = time.monotonic()
        for step in range(40):  # meanwhile others commit tasks due soon, every 100 ms
            others += [int(i) for i in producer.enqueue_many([_task(log, step, delay=0.3)])]
            for k, conn in enumerate(late):
                if mine[k] not in committed and time.monotonic() - started >= 2 + k:
                    conn.commit()
                    committed[mine[k]] = _now_ms()
            time.sleep(0.1)  # the producers' own pace, not a wait for ax
        for k, conn in enumerate(late):
            if mine[k] not in committed:
                conn.commit()
                committed[mine[k]] = _now_ms()
    finally:
        for conn in late:
            conn.close()
        producer.close()
    system.wait_final(len(others) + len(mine), 30)
    runs = log.by_task()
    assert all(len(runs.get(t, [])) == 1 for t in [*mine, *others]), "lost or doubled"
    after_commit = {t: runs[t][0].start - committed[t] for t in mine}
    print(f"\nlate commits: start - commit {after_commit} ms")
    # the task was overdue at its commit: it starts as soon as a woken preload claims it
    assert all(-CLOCK_TOLERANCE_MS <= d < 1_000 for d in after_commit.values()), after_commit


def _race(calls: list[Callable[[], Any]], threads: int = 4) -> list[Any]:
    """Run ``calls`` on a few threads; each result, or the exception it raised."""
    def one(call: Callable[[], Any]) -> Any:
        try:
            return call()
        except (TooLateToMove, IllegalTransition) as exc:
            return exc
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(one, calls))


def _at(deadline_ms: int) -> None:
    """Return at the wall-clock instant ``deadline_ms`` (the race's start, not a wait for
    ax's work)."""
    threading.Event().wait(max(0.0, (deadline_ms - _now_ms()) / 1000))


N_BURST = 600


@pytest.mark.timeout(90)
def test_a_reschedule_racing_the_claim_never_runs_at_the_old_time(
        system: System, tmp_path: Path) -> None:
    log = Ledger(tmp_path / "runs.jsonl")
    lead = system.settings.claim_lead_ms
    ids = system.enqueue_many([_task(log, i, delay=3) for i in range(N_BURST)])
    due = system.tasks()[ids[0]].trigger_time
    _at(due - lead - 250)  # the moves start before the claims and end among them
    results = _race([lambda t=t: system.client.reschedule(t, delay=3) for t in ids])
    moved = {t: r.trigger_time for t, r in zip(ids, results, strict=True)
             if not isinstance(r, Exception)}
    # refused: claimed, staged or running (TooLateToMove), or on a slow day already ended
    # (IllegalTransition) by the time its move was tried
    refused = [t for t, r in zip(ids, results, strict=True) if isinstance(r, IllegalTransition)]
    assert len(moved) + len(refused) == N_BURST
    system.wait_final(N_BURST, 40)
    runs = log.by_task()
    assert all(len(runs.get(t, [])) == 1 for t in ids), "a task was lost or ran twice"
    at_old_time = [t for t, new in moved.items()
                   if runs[t][0].trigger != new or runs[t][0].start < new - CLOCK_TOLERANCE_MS]
    print(f"\n{N_BURST} due together: {len(moved)} moved, {len(refused)} refused")
    assert moved, "no reschedule won the race: the test did not exercise it"
    assert not at_old_time, f"{len(at_old_time)} moved tasks ran at their old time"
    assert all(runs[t][0].trigger == due for t in refused)


@pytest.mark.timeout(90)
def test_a_cancel_by_key_racing_the_claim_never_runs_a_task_cancelled_in_time(
        system: System, tmp_path: Path) -> None:
    log = Ledger(tmp_path / "runs.jsonl")
    lead = system.settings.claim_lead_ms
    ids = system.enqueue_many([_task(log, i, delay=3, biz_key=f"order-{i}")
                               for i in range(N_BURST)])
    due = system.tasks()[ids[0]].trigger_time
    _at(due - lead - 250)
    results = _race([lambda i=i: system.client.cancel(task_type="e2e.task",
                                                      biz_key=f"order-{i}")
                     for i in range(N_BURST)])
    system.wait_final(N_BURST, 40)
    rows = system.tasks()
    runs = log.by_task()
    assert all(len(runs.get(t, [])) <= 1 for t in ids), "a task ran twice"
    cancelled = [t for t in ids if rows[t].status == "CANCELLED"]
    assert sum(not isinstance(r, Exception) for r in results) == len(cancelled)
    assert all(rows[t].status == "SUCCESS" and t in runs for t in ids if t not in cancelled)
    # a staged run checks for a cancel every 50 ms: one cancelled with a margin never starts
    in_time = [t for t in cancelled if rows[t].finished_at < rows[t].trigger_time - 100]
    ran_anyway = [t for t in in_time if t in runs]
    late = [rows[t].finished_at - due for t in cancelled]
    print(f"\n{N_BURST} due together: {len(cancelled)} cancelled ({len(in_time)} ≥100 ms "
          f"before due; cancel − due p50 {pct(late, 50)} ms), {len(runs)} ran")
    assert in_time, "no cancel landed before the due time: the race was not exercised"
    assert not ran_anyway, f"{len(ran_anyway)} tasks ran though cancelled in time"
