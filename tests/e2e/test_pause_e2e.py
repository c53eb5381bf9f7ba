"""Pause and resume under load, in real processes: an ``ax-scheduler`` and an ``ax-worker``
on PostgreSQL + Redis, one cluster for the module. The processor
(:mod:`tests.e2e.pause_tasks`) appends a ledger line per run; the verdicts come from that
ledger and the ``ax_task`` rows.

* **a paused type**: paused, then 500 tasks of it and 500 of another type enqueued due
  now. While the other type's 500 run to the end, none of the paused type is claimed:
  every one stays READY/DELAYED at attempt 0 and the ledger has no run of it, and the
  store's oldest-overdue figure shows them waiting. Resumed, all 500 run, each once.
* **a paused queue, with its tasks already in the scheduler's memory**: 300 tasks for the
  slow queue due in a few seconds and 500 others due now are enqueued (the enqueue wakes
  the preload, which loads them), then the queue is paused before they are due: the claim
  refuses them. None is claimed until well past their time; resumed, each runs once.
* Each pause and resume is in the audit record, with the actor given.

Every wait polls against a deadline; a failure shows each daemon's log tail.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pytest

from ax_kombu.store.audit import read_since
from ax_kombu.store.recovery import oldest_overdue_ms

from .gate_ledger import Entry, LedgerSystem, ledger_cluster

MODULE = "tests.e2e.pause_tasks"
HEARTBEAT = {"heartbeat_interval_s": 0.5, "heartbeat_misses": 3}
#: what the scheduler logs when it reads a changed set of pauses
CHANGED = "the paused task types and queues changed"
LOAD = 500


@dataclass
class PauseSystem(LedgerSystem):
    """One scheduler and one worker whose processors write ``ledger``."""

    def pause_reads(self) -> int:
        """How many changes of the pauses the scheduler has read so far."""
        return self.daemons[0].log.read_text(errors="replace").count(CHANGED)

    def rows(self, ids: list[int]) -> dict[int, Any]:
        return {r.task_id: r for r in self.query(
            "SELECT task_id, status, attempt FROM ax_task WHERE task_id = ANY(:ids)", ids=ids)}

    def enqueue(self, task_type: str, n: int, at_ms: int, priority: str = "default") -> list[int]:
        """``n`` new tasks: each call's payloads are its own (``batch``), so the duplicate
        check (same type and payload within 5 s) never hands back an earlier test's task."""
        run_at = datetime.fromtimestamp(at_ms / 1000, UTC)
        batch = uuid.uuid4().hex
        return self.enqueue_many([{"task_type": task_type, "payload": {"i": i, "batch": batch},
                                   "priority": priority, "run_at": run_at} for i in range(n)])

    def wait_runs(self, task_type: str, count: int, timeout: float) -> list[Entry]:
        self.wait_for(lambda: len(self.runs(task_type)) >= count, timeout,
                      f"{count} runs of {task_type}",
                      detail=lambda: f"{len(self.runs(task_type))} runs; {self.statuses()}")
        return self.runs(task_type)

    def wait_pause_read(self, before: int) -> None:
        self.wait_for(lambda: self.pause_reads() > before, 20, "the scheduler read the pause")


@pytest.fixture(scope="module")
def cluster(pg_database: str, redis_url: str,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[PauseSystem]:
    """One scheduler and one worker on this run's database (emptied) and their own Redis
    queues and key prefix."""
    with ledger_cluster(PauseSystem, pg_database, redis_url, tmp_path_factory, "pause",
                        "ax_task, ax_node, ax_job, ax_limit, ax_due, ax_pause, ax_audit",
                        HEARTBEAT) as ax:
        ax.scheduler("pause-s0")
        ax.worker("pause-w0", args=("-A", MODULE))
        ax.wait_ready()
        yield ax


def assert_unclaimed(cluster: PauseSystem, ids: list[int], task_type: str) -> None:
    """None of ``ids`` was ever claimed: waiting, attempt 0, no run in the ledger."""
    rows = cluster.rows(ids)
    assert len(rows) == len(ids)
    assert Counter(r.status for r in rows.values()).keys() <= {"READY", "DELAYED"}, \
        Counter(r.status for r in rows.values())
    assert {r.attempt for r in rows.values()} == {0}
    assert cluster.runs(task_type) == []


def assert_ran_once(cluster: PauseSystem, ids: list[int], task_type: str) -> None:
    runs = cluster.wait_runs(task_type, len(ids), 120)
    per_task = Counter(e.task_id for e in runs)
    assert set(per_task) == set(ids)
    assert max(per_task.values()) == 1, [t for t, n in per_task.items() if n > 1][:10]
    cluster.wait_for(lambda: {r.status for r in cluster.rows(ids).values()} == {"SUCCESS"},
                     30, f"every {task_type} SUCCESS")
    assert {r.attempt for r in cluster.rows(ids).values()} == {1}


@pytest.mark.e2e
@pytest.mark.integration
@pytest.mark.timeout(240)
def test_a_paused_type_waits_under_load_and_runs_once_when_resumed(
        cluster: PauseSystem) -> None:
    seen = cluster.pause_reads()
    assert cluster.client.pause_type("pause.held", actor="e2e-op") is True
    cluster.wait_pause_read(seen)
    now = cluster.client.store.now_ms()
    earlier = len(cluster.runs("pause.other"))  # the tests' order is random
    held = cluster.enqueue("pause.held", LOAD, now)
    other = cluster.enqueue("pause.other", LOAD, now)

    # the window: while the other type's tasks all run, the paused type's wait
    cluster.wait_runs("pause.other", earlier + LOAD, 120)
    assert_unclaimed(cluster, held, "pause.held")
    with cluster.reader.connect() as conn:  # their lateness shows
        assert oldest_overdue_ms(conn, cluster.client.store.now_ms()) > 0

    seen = cluster.pause_reads()
    assert cluster.client.resume_type("pause.held", actor="e2e-op") is True
    assert_ran_once(cluster, held, "pause.held")
    assert len(cluster.runs("pause.other")) == earlier + len(other)
    assert cluster.pause_reads() > seen
    actions = [(e.actor, e.action, e.target) for e in read_since(cluster.client.store.engine, 0)
               if e.target == "type:pause.held"]
    assert actions == [("e2e-op", "resume_type", "type:pause.held"),
                       ("e2e-op", "pause_type", "type:pause.held")]


@pytest.mark.e2e
@pytest.mark.integration
@pytest.mark.timeout(240)
def test_a_queue_paused_with_its_tasks_loaded_is_not_claimed_until_resumed(
        cluster: PauseSystem) -> None:
    slow = cluster.settings.queue_for("slow")
    now = cluster.client.store.now_ms()
    due = now + 4000
    earlier = len(cluster.runs("pause.other"))  # the tests' order is random
    queued = cluster.enqueue("pause.queued", 300, due, priority="slow")
    other = cluster.enqueue("pause.other", LOAD, now)
    seen = cluster.pause_reads()
    assert cluster.client.pause_queue(slow, actor="e2e-op") is True
    cluster.wait_pause_read(seen)
    lead = cluster.settings.claim_lead_ms
    assert cluster.client.store.now_ms() < due - lead, "the pause landed too late to test"

    # the window: the other tasks all run, and the queue's tasks are 2 s past due
    cluster.wait_runs("pause.other", earlier + LOAD, 120)
    cluster.wait_for(lambda: cluster.client.store.now_ms() > due + 2000, 30, "2 s past due")
    assert_unclaimed(cluster, queued, "pause.queued")

    assert cluster.client.resume_queue(slow, actor="e2e-op") is True
    assert_ran_once(cluster, queued, "pause.queued")
    assert len(cluster.runs("pause.other")) == earlier + len(other)
    actions = [e.action for e in read_since(cluster.client.store.engine, 0)
               if e.target == f"queue:{slow}"]
    assert actions == ["resume_queue", "pause_queue"]
