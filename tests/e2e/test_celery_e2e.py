"""ax as the countdown backend of a Celery app, in real processes: two ``ax-scheduler`` s and an
unmodified ``celery -A tests.e2e.celery_app worker`` on Redis (under this test's key prefix),
PostgreSQL as ax's store. One tier: the Celery message ax publishes to RabbitMQ is tested by
tests/integration/test_celery.py on both brokers.

The countdown test (issue 16's "tasks via ``apply_async(countdown=…)`` after ``install(app)``
all run exactly once, on time"): N = 1,000 calls ``record.apply_async(..., countdown=…)`` from
:data:`PRODUCERS` threads, stored in ax, claimed by one of the 2 schedulers when due (never
staged ahead: a Celery-bound task is claimed only once its trigger time has come on the
scheduler's database clock) and run by the Celery worker. The task body appends one line per
run to a ledger file; judged from it:

* exactly once: N lines, one per call, each under the Celery id of the ax task's first
  attempt (``AsyncResult.id``), each ax task SUCCESS at its hand-off;
* never early: no run starts before its trigger time (the worker's wall clock against
  PostgreSQL's, one host: :data:`~tests.e2e.system.CLOCK_TOLERANCE_MS` is allowed for the
  two clock readings);
* on time: ax claimed each when due, never before (``dispatched_at`` ≥ trigger time),
  claimed − due p99 ≤ :data:`CLAIM_P99_MS`, max ≤ :data:`CLAIM_MAX_MS`; and start − trigger
  time p99 ≤ :data:`P99_LATE_MS`, max ≤ :data:`MAX_LATE_MS` (see there why).

Why spread, not one instant: task i falls due ``LEAD_S + SPREAD_S · i / N`` s after production
began (its countdown computed at the call), so the N due times cover ``SPREAD_S``, after the
producing is done (see :data:`LEAD_S`). This test is about ax's timing in front of a stock
Celery worker; N due in the same millisecond would measure only how fast one stock worker
drains a backlog. Spread at a rate one worker can take (200 due a second), lateness is ax's
part plus the worker's delivery, not a queue.

The 10,000-task version (30 s of lead, 30 s of spread, about 70 s a run) is a benchmark:
``python -m bench.celery_e2e`` runs this same test with those figures.

The worker: ``-P threads -c 8``, ``-l WARNING`` (see :class:`CeleryWorker`). Meanwhile a
``beat_schedule`` entry (every second), imported with ``import_beat_schedule``, fires through
the same 2 schedulers: one task per occurrence, each run once.

``AX_CELERY_E2E_N``, ``AX_CELERY_E2E_LEAD_S`` and ``AX_CELERY_E2E_SPREAD_S`` change N, the
lead and the spread (``bench/celery_e2e.py`` sets them for 10,000 tasks);
``AX_CELERY_E2E_CLAIM_LEAD_MS`` sets the schedulers' ``claim_lead_ms``.

With :class:`ax_kombu.celery.AxBootstep` in two Celery workers on Redis:
one is SIGKILLed while running ax's tasks; they run again on the other within ax's recovery
window (seconds), not after Redis's visibility timeout (1 h), each ending SUCCESS once; what
the killed worker had not started runs once. (On RabbitMQ a dead consumer's unacked messages
come back at once, so Redis is where the visibility timeout would hurt.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from ..waiting import wait_until
from .system import CLOCK_TOLERANCE_MS, REPO, System, pct

celery = pytest.importorskip("celery")

import ax_kombu.celery as axc
from ax_kombu.broker.celery_wire import celery_task_id

from . import celery_app

pytestmark = [pytest.mark.e2e, pytest.mark.integration]
#: when the tasks fall due: task i at LEAD_S + SPREAD_S · i / N after production began, each
#: call's countdown computed to match. LEAD_S covers producing: while the producer threads and
#: PostgreSQL fill both cores, a stock worker gets little CPU, so tasks coming due during
#: production queue up behind it. SPREAD_S keeps the due rate under what one stock worker
#: drains on Redis on this machine on a slow day (docs/benchmarks.md has the figures).
LEAD_S = float(os.environ.get("AX_CELERY_E2E_LEAD_S", "5"))
SPREAD_S = float(os.environ.get("AX_CELERY_E2E_SPREAD_S", "5"))
N = int(os.environ.get("AX_CELERY_E2E_N", "0")) or 1_000
#: Bounds on lateness. ax's part, claimed − due (both on the database clock, from the row):
#: the wheel's tick (1 ms), then one claim round trip; a batch waits behind the one before
#: it, so p99 is tens of ms even on a loaded machine (measured 127–142 ms at load 13). Then
#: the publish, the broker and the stock worker: its consume loop takes one message at a
#: time (on Redis one BRPOP plus two pipelines, the unacked index and the ack, per message),
#: so when the machine's 2 cores are shared with two schedulers, PostgreSQL, the broker, the
#: producer threads (still producing while the first tasks come due) and other jobs, the
#: worker trails by up to seconds: start − due p50 63 / 347 ms, p99 621 / 2,070 ms, max 732 /
#: 2,370 ms on RabbitMQ / Redis at load 11–13 (2026-12-03). The bounds leave room for that on
#: a shared CI runner, and are still under SPEC's critical schedule-delay level (10 s) and
#: Celery's own ETA for this count (p99 5–19 s, issue 16):
CLAIM_P99_MS, CLAIM_MAX_MS = 250, 1000
P99_LATE_MS, MAX_LATE_MS = 3000, 5000
#: Producer threads. One apply_async is an ax enqueue: about three round trips to PostgreSQL
#: and a commit (≈ 2.7 ms, ≈ 370 calls/s from one thread here); the threads overlap those
#: waits: 8 made ≈ 570/s and 16 ≈ 810/s on this 2-core machine under load (2,000 calls).
PRODUCERS = 16
#: how long a run of the kill test takes
RUN_S = 2.0


class CeleryWorker:
    """One ``celery worker`` subprocess, its output in a log file.

    ``-P threads -c 8``: what limits a stock worker here is its one consuming thread
    (Kombu's receive, one message at a time; on Redis a BRPOP plus the unacked-index and
    ack pipelines per message), not the pool. Draining 5,000 queued ``record`` calls on
    Redis at load 7–9 (2026-12-03): threads -c 8 prefetch ×4 630/s, ×16 626/s; solo 651/s;
    prefork -c 2 575/s (a pipe round trip to a child per task). So the threads pool, which
    stays close to the best with the concurrency a real app needs, and Celery's default
    prefetch. ``-l WARNING`` for the countdown test: at ``INFO`` Celery logs two lines per
    task on that same thread.
    """

    def __init__(self, broker_url: str, prefix: str, queue: str, tmp: Path, name: str,
                 concurrency: int = 8, env: dict[str, str] | None = None,
                 loglevel: str = "INFO", pool: str = "threads",
                 app: str = "tests.e2e.celery_app") -> None:
        self.log = tmp / f"{name}.log"
        environ = {k: v for k, v in os.environ.items() if not k.startswith("AX_")}
        environ.update(PYTHONPATH=os.pathsep.join(p for p in (str(REPO),
                                                              environ.get("PYTHONPATH")) if p),
                       AX_TEST_CELERY_BROKER=broker_url, AX_TEST_CELERY_PREFIX=prefix,
                       AX_TEST_CELERY_QUEUE=queue, **(env or {}))
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", app, "worker",
                 "-P", pool, "-c", str(concurrency), "-Q", queue, "-n", f"{name}@%h",
                 "-l", loglevel,
                 "--without-gossip", "--without-mingle", "--without-heartbeat"],
                cwd=tmp, env=environ, stdout=out, stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.output().splitlines()[-lines:])

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until the worker logs "ready." (at WARNING too: see :mod:`tests.e2e.celery_app`)."""
        wait_until(lambda: "ready." in self.output() or self.proc.poll() is not None,
                   timeout, 0.1)
        if self.proc.poll() is not None or "ready." not in self.output():
            raise AssertionError(f"celery worker not ready:\n{self.tail()}")

    def stop(self) -> None:
        """Cold shutdown (SIGQUIT), SIGKILL after 3 s: the test is over, nothing is left to
        finish (on RabbitMQ a cold shutdown can take 10 s closing its connection)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)
            try:
                self.proc.wait(3)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def runs(log: Path) -> list[dict[str, Any]]:
    """The complete lines of a run log (one being written may be cut short)."""
    lines = log.read_text().split("\n")[:-1] if log.exists() else []
    return [json.loads(line) for line in lines]


def count_runs(log: Path) -> int:
    return log.read_bytes().count(b"\n") if log.exists() else 0


@pytest.mark.timeout(240)
def test_countdown_calls_run_once_each_on_time_in_an_unmodified_celery_worker(
        pg_url: str, redis_broker: dict[str, str], tmp_path: Path) -> None:
    broker = redis_broker
    system = System(pg_url, broker, tmp_path)
    redis = broker["broker_url"].startswith("redis")
    prefix = broker.get("broker_key_prefix", "")
    queue = f"celery.{broker['queue_default']}"
    celery_app.configure(broker["broker_url"], prefix, queue)
    worker = CeleryWorker(broker["broker_url"], prefix, queue, tmp_path, "celery-w1",
                          loglevel="WARNING")
    log = tmp_path / "celery-runs.jsonl"
    beat_log = tmp_path / "beat-runs.jsonl"
    began = time.monotonic()
    try:
        lead = os.environ.get("AX_CELERY_E2E_CLAIM_LEAD_MS")  # see the module docstring
        for i in (1, 2):
            system.scheduler(f"sched-celery-{i}", env={"claim_lead_ms": lead} if lead else None)
        system.wait_ready()
        worker.wait_ready()
        celery_app.app.conf.beat_schedule = {"tick": {
            "task": "e2e.celery.record", "schedule": timedelta(seconds=1),
            "args": (str(beat_log), -1)}}
        axc.import_beat_schedule(celery_app.app, client=system.client, prefix="beat:")
        axc.install(celery_app.app, client=system.client)
        record = celery_app.app.tasks["e2e.celery.record"]
        started = time.monotonic()
        with ThreadPoolExecutor(PRODUCERS) as producers:
            results = list(producers.map(lambda i: record.apply_async((str(log), i), countdown=max(
                0.0, started + LEAD_S + SPREAD_S * i / N - time.monotonic())), range(N)))
        produced_s = time.monotonic() - started
        deadline = started + max(LEAD_S, produced_s) + SPREAD_S + 60
        wait_until(lambda: count_runs(log) >= N or worker.proc.poll() is not None,
                   deadline - time.monotonic(), 0.2)
        if count_runs(log) < N:
            raise AssertionError(f"{count_runs(log)}/{N} ran\n{worker.tail()}\n"
                                 f"{system.tails()}")
        system.wait_for(lambda: system.query(
            "SELECT count(*) FROM ax_task WHERE job IS NULL AND status = 'SUCCESS'")[0][0] == N,
            30, f"{N} ax tasks SUCCESS", detail=system.statuses)
        handed_ticks = system.wait_for(lambda: beat_ran(system, beat_log), 10,
                                       "every handed-off tick ran")
    finally:
        worker.stop()
        axc.uninstall(celery_app.app)
        celery_app.app.conf.beat_schedule = {}
        system.close()
    took_s = time.monotonic() - began
    done = runs(log)
    every = system.tasks()
    tasks = {i: row for i, row in every.items() if row.job is None}
    assert len(done) == N and len({r["i"] for r in done}) == N  # exactly once each
    assert len(tasks) == N and {r["ax"] for r in done} == set(tasks)
    assert sorted(res.id for res in results) == sorted(r["id"] for r in done)
    late: list[int] = []
    sent_late = [row.dispatched_at - row.trigger_time for row in tasks.values()]  # ax's part
    for r in done:
        row = tasks[r["ax"]]
        assert row.status == "SUCCESS" and r["attempt"] == row.attempt == 1
        assert r["id"] == celery_task_id(row.task_id, 1) == json.loads(row.result)[
            "celery_task_id"]
        assert r["eta"] is None
        late.append(r["start"] - row.trigger_time)
    early = sorted(x for x in late if x < 0)
    assert min(late) >= -CLOCK_TOLERANCE_MS, f"started early: {early[:10]} ms"
    starts = sorted(r["start"] for r in done)
    due = sorted(row.trigger_time for row in tasks.values())
    print(f"\n{N} Celery tasks via ax ({'redis' if redis else 'rabbitmq'}): produced in "
          f"{produced_s:.1f} s ({N / produced_s:.0f}/s); due over "
          f"{(due[-1] - due[0]) / 1000:.1f} s, started over {(starts[-1] - starts[0]) / 1000:.1f}"
          f" s; lateness p50 {pct(late, 50)} ms, p99 {pct(late, 99)} ms, max {max(late)} ms, "
          f"min {min(late)} ms; claimed − due p50 {pct(sent_late, 50)} ms, p99 "
          f"{pct(sent_late, 99)} ms, min {min(sent_late)} ms; the test took {took_s:.1f} s")
    assert pct(sent_late, 99) <= CLAIM_P99_MS and max(sent_late) <= CLAIM_MAX_MS, (
        pct(sent_late, 99), max(sent_late))
    assert min(sent_late) >= 0  # claimed when due, never staged ahead
    assert pct(late, 99) <= P99_LATE_MS and max(late) <= MAX_LATE_MS, (
        pct(late, 99), max(late))
    print(f"{check_beat(every, beat_log, handed_ticks)} beat occurrences, each run once")


def beat_ran(system: System, beat_log: Path) -> set[int] | None:
    """The beat tasks handed off to Celery so far, once each has a line in ``beat_log``."""
    handed = {r[0] for r in system.query(
        "SELECT task_id FROM ax_task WHERE job = 'beat:tick' AND status = 'SUCCESS'")}
    return handed if handed <= {r["ax"] for r in runs(beat_log)} else None


def check_beat(every: dict[int, Any], beat_log: Path, handed: set[int]) -> int:
    """The beat entry, fired by 2 schedulers: one task per occurrence, each handed off
    (``handed``: those seen before the worker stopped) run exactly once, none run that was
    not handed off; returns how many ran."""
    ticks = {i: row for i, row in every.items() if row.job == "beat:tick"}
    ran = [r["ax"] for r in runs(beat_log)]
    assert len({row.scheduled_at for row in ticks.values()}) == len(ticks)
    assert len(set(ran)) == len(ran)
    assert handed <= set(ran) <= {i for i, row in ticks.items() if row.status == "SUCCESS"}
    assert len(ran) >= LEAD_S + SPREAD_S - 2  # about one a second while the test ran
    return len(ran)


@pytest.mark.timeout(120)
def test_a_killed_celery_workers_tasks_run_on_another_within_the_recovery_window(
        pg_url: str, redis_broker: dict[str, str], tmp_path: Path) -> None:
    broker = redis_broker  # where a killed worker's messages wait for the visibility timeout
    ax = System(pg_url, broker, tmp_path, env={"ack_timeout_ms": 4000})
    prefix = broker.get("broker_key_prefix", "")
    queue = f"celery.{broker['queue_default']}"
    fenced_env = {"AX_DATABASE_URL": pg_url, "AX_HEARTBEAT_INTERVAL_S": "0.5",
                  "AX_HEARTBEAT_MISSES": "3", "AX_TEST_CELERY_BOOTSTEP": "1"}
    workers = [CeleryWorker(broker["broker_url"], prefix, queue, tmp_path, f"cw{i}",
                            concurrency=4, env=fenced_env) for i in (1, 2)]
    log = tmp_path / "celery-runs.jsonl"
    n = 8
    try:
        ax.scheduler("sched-kill")
        ax.wait_ready()
        for w in workers:
            w.wait_ready()
        nodes = ax.wait_for(lambda: sorted(n_ for n_ in ax.live_nodes()
                                           if n_.startswith("celery@cw")) or None, 20,
                            "both Celery workers registered in ax")
        assert len(nodes) == 2
        celery_app.configure(broker["broker_url"], prefix, queue)
        ids = [int(axc.enqueue(celery_app.app, "e2e.celery.record", args=(str(log), i, RUN_S),
                               countdown=0.5, fenced=True, client=ax.client))
               for i in range(n)]
        victim = next(node for node in nodes if node.startswith("celery@cw1@"))
        was_running = ax.wait_for(lambda: ax.running_on(victim), 20, "a task running on cw1")
        killed = time.monotonic()
        workers[0].proc.send_signal(signal.SIGKILL)
        workers[0].proc.wait(10)
        ax.wait_for(lambda: ax.statuses()["SUCCESS"] == n, 40, f"{n} tasks SUCCESS",
                    detail=ax.statuses)
        recovered_s = time.monotonic() - killed
    finally:
        for w in workers:
            w.stop()
        ax.close()
    tasks = ax.tasks()
    done = runs(log)
    by_task: dict[int, list[dict[str, Any]]] = {}
    for r in done:
        by_task.setdefault(r["ax"], []).append(r)
    assert set(by_task) == set(ids)
    for task_id in ids:
        row, task_runs = tasks[task_id], by_task[task_id]
        assert row.status == "SUCCESS" and row.owner_node.startswith("celery@cw")
        assert [r["attempt"] for r in task_runs] == sorted({r["attempt"] for r in task_runs})
        # RUNNING on cw1 when it was killed (was_running was read just before the kill, so
        # a task may have started on cw1 after that read): run again, a new attempt, on cw2
        cut = task_id in was_running or (len(task_runs) > 1
                                         and task_runs[0]["worker"].startswith("cw1@"))
        if cut and not task_runs[0]["worker"].startswith("cw1@"):
            # fenced ahead on cw1 (its message arrived before the due instant) and never
            # started there: run once, on cw2, at a new attempt
            assert row.owner_node.startswith("celery@cw2@") and row.attempt >= 2
            assert len(task_runs) == 1, task_runs
        elif cut:
            assert row.owner_node.startswith("celery@cw2@") and row.attempt >= 2
            assert task_runs[0]["worker"].startswith("cw1@")
            assert all(r["worker"].startswith("cw2@") for r in task_runs[1:]), task_runs
        else:
            assert len(task_runs) == 1
    print(f"\ncw1 SIGKILLed running {len(was_running)} tasks; all {n} SUCCESS "
          f"{recovered_s:.1f} s after the kill (a run takes {RUN_S:g} s)")
    assert recovered_s < 20
