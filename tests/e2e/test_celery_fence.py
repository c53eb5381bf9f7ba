"""The AxBootstep's fence in real processes (issue 22, item 8): one ``ax-scheduler`` and one
unmodified ``celery worker`` with :class:`ax_kombu.celery.AxBootstep`
(:mod:`tests.e2e.celery_fence_app`), PostgreSQL as ax's store, Redis as the broker. The task
body appends one line per run to a ledger file (ax task id, attempt, pid), judged with the
task rows:

* **A prefork child killed mid-run** (SIGKILL, as the OOM killer does): its task leaves
  RUNNING within seconds while the worker's main process lives on — retried when retries
  remain (the retry runs once), FAILED "worker lost" when none do. Before: it stayed
  RUNNING on a node that kept heartbeating, until the whole Celery worker was restarted.
* **``revoke(terminate=True)``** of a running task (the child is killed by the signal):
  the row is final (CANCELLED) and the task never runs again. Before: RUNNING for good.
* **A stale incarnation starts nothing**: the worker's node is declared dead (its row
  stopped) while its process lives, and kept so (the node row locked) that it cannot
  register again; a task published to it meanwhile is not moved RUNNING and its body does
  not run; once the worker has registered a new incarnation, the task runs once, under it.
  Before: the body ran at once, under the dead incarnation.
* **Staged and on time** (item 9): tasks for the bootstep's workers are published up to
  1 s ahead with Celery's ``eta``, kept by the worker's timer and fenced when
  due: each runs once, none before its trigger time, each message carried the ``eta``
  (the lateness figures come from ``bench/celery_countdown.py``, not from this test).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from .system import CLOCK_TOLERANCE_MS, System, pct
from .test_celery_e2e import CeleryWorker, runs

celery = pytest.importorskip("celery")

from . import celery_fence_app

pytestmark = [pytest.mark.e2e, pytest.mark.integration]
APP = "tests.e2e.celery_fence_app"
#: how long the first attempt's body sleeps: far longer than any wait below
LONG_S = 60.0


class Rig:
    """The scheduler, the Celery worker and the ledger of one test."""

    def __init__(self, pg_url: str, broker: dict[str, str], tmp: Path, pool: str,
                 ack_timeout_ms: int = 15_000) -> None:
        self.system = System(pg_url, broker, tmp, env={"ack_timeout_ms": ack_timeout_ms})
        self.prefix = broker.get("broker_key_prefix", "")
        self.queue = f"celery.{broker['queue_default']}"
        self.ledger = tmp / "fence-runs.jsonl"
        celery_fence_app.configure(broker["broker_url"], self.prefix, self.queue)
        env = {"AX_DATABASE_URL": pg_url, "AX_HEARTBEAT_INTERVAL_S": "0.5",
               "AX_HEARTBEAT_MISSES": "3", "AX_RETRY_BACKOFF_BASE_MS": "100",
               "AX_RETRY_BACKOFF_MAX_MS": "200"}
        self.system.scheduler("sched-fence")
        self.worker = CeleryWorker(broker["broker_url"], self.prefix, self.queue, tmp, "cf",
                                   concurrency=2, env=env, pool=pool, app=APP)
        self.system.wait_ready()
        self.worker.wait_ready()
        self.node = self.system.wait_for(
            lambda: next((n for n in self.system.live_nodes() if n.startswith("celery@cf@")),
                         None), 20, "the Celery worker registered in ax")

    def enqueue(self, i: int, max_retry: int, first_sleep: float = LONG_S,
                delay: float = 0.2) -> int:
        return int(self.system.client.enqueue_to(
            "celery_ax", "fence.run", {"args": [str(self.ledger), i, first_sleep],
                                       "kwargs": {}},
            processor=f"celery+ax:{self.queue}", delay=delay, max_retry=max_retry))

    def row(self, task_id: int) -> Any:
        return self.system.tasks()[task_id]

    def runs_of(self, task_id: int) -> list[dict[str, Any]]:
        return [r for r in runs(self.ledger) if r["ax"] == task_id]

    def close(self) -> None:
        self.worker.stop()
        self.system.close()


@pytest.mark.timeout(60)
def test_a_killed_prefork_childs_task_leaves_running_while_the_parent_lives(
        pg_url: str, redis_broker: dict[str, str], tmp_path: Path) -> None:
    rig = Rig(pg_url, redis_broker, tmp_path, "prefork")
    try:
        retried, failed = rig.enqueue(1, max_retry=2), rig.enqueue(2, max_retry=0)
        first = rig.system.wait_for(
            lambda: (len(runs(rig.ledger)) == 2 and rig.system.running_on(rig.node)
                     == {retried, failed}) and runs(rig.ledger), 20,
            "both tasks running in a child", detail=rig.system.statuses)
        incarnation = rig.system.node(rig.node).incarnation
        children = {r["pid"] for r in first}
        assert rig.worker.proc.pid not in children and len(children) == 2
        killed = time.monotonic()
        for pid in children:
            os.kill(pid, signal.SIGKILL)
        rig.system.wait_for(lambda: rig.row(failed).status == "FAILED"
                            and rig.row(retried).status == "SUCCESS", 15,
                            "the killed runs recorded", detail=rig.system.statuses)
        recorded_s = time.monotonic() - killed
        assert rig.worker.proc.poll() is None  # the parent lived on
        node = rig.system.node(rig.node)
        assert node.stopped_at is None and node.incarnation == incarnation  # never declared dead
        lost = rig.row(failed)
        assert "worker lost" in lost.last_error and "WorkerLostError" in lost.last_error
        again = rig.row(retried)
        assert (again.attempt, again.retry_count) == (2, 1)
        assert [r["attempt"] for r in rig.runs_of(retried)] == [1, 2]  # the retry ran once
        assert [r["attempt"] for r in rig.runs_of(failed)] == [1]
        assert [a.outcome for a in rig.system.client.get(retried).attempts][:1] == ["LOST"]
    finally:
        rig.close()
    print(f"\n2 prefork children SIGKILLed mid-run: recorded {recorded_s:.1f} s after the kill, "
          "the worker's main process alive")


@pytest.mark.timeout(60)
def test_revoke_terminate_makes_the_row_final(pg_url: str, redis_broker: dict[str, str],
                                              tmp_path: Path) -> None:
    rig = Rig(pg_url, redis_broker, tmp_path, "prefork")
    try:
        task_id = rig.enqueue(1, max_retry=3)
        run = rig.system.wait_for(lambda: rig.runs_of(task_id), 20, "the task running")[0]
        assert rig.row(task_id).status == "RUNNING"
        celery_fence_app.app.control.revoke(run["id"], terminate=True)
        rig.system.wait_for(lambda: rig.row(task_id).status == "CANCELLED", 15,
                            "the revoked run final", detail=lambda: rig.row(task_id).status)
        row = rig.row(task_id)
        assert "revoked in Celery" in row.last_error and row.finished_at is not None
        assert rig.worker.proc.poll() is None
        # final: the scheduler never sends it again (a new attempt would show in the row)
        rig.system.wait_for(lambda: rig.system.query(
            "SELECT count(*) FROM ax_task WHERE status IN ('DELAYED', 'READY', 'DISPATCHING',"
            " 'RUNNING')")[0][0] == 0, 5, "nothing left to run")
        assert rig.row(task_id).attempt == 1 and len(rig.runs_of(task_id)) == 1
    finally:
        rig.close()


@pytest.mark.timeout(60)
def test_a_stale_incarnation_cannot_move_a_row_running(
        pg_url: str, redis_broker: dict[str, str], tmp_path: Path) -> None:
    rig = Rig(pg_url, redis_broker, tmp_path, "threads", ack_timeout_ms=4000)
    system = rig.system
    try:
        old = system.node(rig.node).incarnation
        with system.reader.begin() as conn:  # declared dead, as a peer's judging would
            conn.execute(text("UPDATE ax_node SET stopped_at = heartbeat_at "
                              "WHERE node_id = :n"), {"n": rig.node})
        hold = system.reader.connect()
        tx = hold.begin()
        hold.execute(text("SELECT 1 FROM ax_node WHERE node_id = :n FOR UPDATE"),
                     {"n": rig.node})  # it cannot register again while this lock is kept
        try:
            task_id = rig.enqueue(1, max_retry=0, first_sleep=0.0)
            system.wait_for(lambda: rig.row(task_id).status != "DELAYED", 10,
                            "the task published", detail=lambda: rig.row(task_id).status)
            kept_until = time.monotonic() + 3.0  # the worker has had it for ~3 s
            while time.monotonic() < kept_until:
                assert rig.runs_of(task_id) == [], "started under a dead incarnation"
                assert rig.row(task_id).status not in ("RUNNING", "SUCCESS"), rig.row(task_id)
                time.sleep(0.1)
        finally:
            tx.rollback()
            hold.close()
        system.wait_for(lambda: rig.row(task_id).status == "SUCCESS", 20,
                        "the task run once the worker registered again",
                        detail=lambda: rig.row(task_id).status)
        node = system.node(rig.node)
        assert node.stopped_at is None and node.incarnation > old
        done = rig.runs_of(task_id)
        assert len(done) == 1  # once, under the new incarnation
        assert rig.row(task_id).started_at >= node.started_at
    finally:
        rig.close()


@pytest.mark.timeout(60)
def test_staged_celery_tasks_run_once_each_never_before_due(
        pg_url: str, redis_broker: dict[str, str], tmp_path: Path) -> None:
    rig = Rig(pg_url, redis_broker, tmp_path, "threads")
    n = 200
    try:
        ids = [rig.enqueue(i, max_retry=0, first_sleep=0.0, delay=1.5 + i / 100)
               for i in range(n)]
        rig.system.wait_for(lambda: rig.system.statuses()["SUCCESS"] == n, 30,
                            f"{n} tasks SUCCESS", detail=rig.system.statuses)
        rig.system.wait_for(lambda: len(runs(rig.ledger)) >= n, 5, "every run in the ledger")
        tasks = rig.system.tasks()
    finally:
        rig.close()
    done = runs(rig.ledger)
    assert sorted(r["ax"] for r in done) == sorted(ids)  # each once
    late = [r["start"] - tasks[r["ax"]].trigger_time for r in done]
    assert min(late) >= -CLOCK_TOLERANCE_MS, sorted(late)[:10]  # never before due
    staged = [r for r in done if tasks[r["ax"]].dispatched_at < tasks[r["ax"]].trigger_time]
    assert staged and all(r["eta"] for r in staged)  # kept by Celery's own eta timer
    assert all(tasks[i].attempt == 1 and tasks[i].started_at >= tasks[i].trigger_time
               for i in ids)
    print(f"\n{n} staged Celery tasks ({len(staged)} published ahead): start - due p50 "
          f"{pct(late, 50)} ms, p99 {pct(late, 99)} ms, min {min(late)} ms")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_a_task_cancelled_after_it_was_fenced_ahead_never_runs(
        pg_url: str, redis_broker: dict[str, str], tmp_path: Path, pool: str) -> None:
    """A message published ahead is moved RUNNING as it arrives (fenced ahead); ``ax
    cancel`` before its due instant still wins: with threads the heartbeat drops the run
    the process moved (its start then reads the row), a prefork child reads the row at
    start. Either way the body never runs and the row stays CANCELLED. A task due at the
    same time and not cancelled runs once."""
    rig = Rig(pg_url, redis_broker, tmp_path, pool)
    try:
        cancelled = rig.enqueue(1, max_retry=0, first_sleep=0.0, delay=3.0)
        kept = rig.enqueue(2, max_retry=0, first_sleep=0.0, delay=3.0)
        rig.system.wait_for(lambda: {rig.row(t).status for t in (cancelled, kept)} == {"RUNNING"},
                            10, "both moved RUNNING ahead of their due instant",
                            detail=rig.system.statuses)
        due = rig.row(cancelled).trigger_time
        assert rig.system.client.store.now_ms() < due - 500  # the cancel comes well before
        assert rig.system.client.cancel(cancelled)
        rig.system.wait_for(lambda: rig.row(kept).status == "SUCCESS", 15, "the other task ran")
        rig.system.wait_for(lambda: rig.system.client.store.now_ms() > due + 1000, 5,
                            "a second past the due instant")
        assert rig.row(cancelled).status == "CANCELLED"
    finally:
        rig.close()
    assert rig.runs_of(cancelled) == []
    assert len(rig.runs_of(kept)) == 1
