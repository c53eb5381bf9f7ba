"""The whole product in real processes: ``ax-scheduler`` and ``ax-worker`` subprocesses,
stopped with real signals; the test only enqueues and reads the database.

On PostgreSQL + Redis and PostgreSQL + RabbitMQ (the ``broker`` fixture), then the
same smaller flow on the embedded default (SQLite store + ax's SQLite broker):

* many tasks through 2 schedulers and 2 workers: each runs once, never early;
* retries: SUCCESS after two failures, spaced as the backoff settings say;
* timeouts: recorded as such, FAILED without retries left, the slot accounted for;
* pool isolation: a saturated slow pool does not delay high-priority tasks
  (these three on Redis alone: tests/integration/test_worker.py has each on both brokers,
  the worker in-process: ``test_failing_twice_then_succeeding_retries_with_backoff``,
  ``test_a_timeout_is_signalled_and_recorded_only_when_the_thread_returns``,
  ``test_a_saturated_slow_pool_does_not_delay_high_priority_tasks``);
* SIGTERM of a worker: warm shutdown, exit 0, nothing lost or run twice (on Redis alone: a
  broker changes nothing in how a worker's stop is handled);
* on the embedded default, ``kill -9`` of a worker mid-task (the SQLite broker's own path):
  nothing lost, only its running tasks run twice. On PostgreSQL with a server broker a
  worker's SIGKILL is the fault suite's (tests/faults/test_faults.py
  ``test_sigkill_a_worker_mid_task``, which checks what this file's Redis test did).

Every wait polls the database against a deadline; a failure shows each daemon's log tail.
"""

from __future__ import annotations

import itertools
import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ..ledger import Ledger, Run
from .system import CLOCK_TOLERANCE_MS, System, pct

PRIORITIES = ("high", "default", "slow")


@pytest.fixture
def redis_system(pg_url: str, redis_broker: dict[str, str], tmp_path: Path) -> Iterator[System]:
    """On Redis alone: for a worker's stop, which no broker changes, and for behaviour the
    integration tier tests on both brokers (tests/integration/test_worker.py)."""
    ax = System(pg_url, redis_broker, tmp_path)
    yield ax
    ax.close()


@pytest.fixture
def system(pg_url: str, broker: dict[str, str], tmp_path: Path) -> Iterator[System]:
    ax = System(pg_url, broker, tmp_path)
    yield ax
    ax.close()


def _task(log: Ledger, i: int, **payload: Any) -> dict[str, Any]:
    return {"task_type": "e2e.task", "payload": {"log": str(log), "i": i, **payload}}


# -- a. many tasks, 2 schedulers + 2 workers ----------------------------------------------------

N_MANY = 3000


@pytest.mark.e2e
@pytest.mark.integration
@pytest.mark.timeout(120)
def test_many_tasks_run_once_each_and_never_early(system: System, tmp_path: Path) -> None:
    log = Ledger(tmp_path / "runs.jsonl")
    for i in range(2):
        system.scheduler(f"sched-{i}")
    workers = [system.worker(f"worker-{i}") for i in range(2)]
    system.wait_ready()
    ids = system.enqueue_many([{**_task(log, i), "delay": 1 + 3 * i / N_MANY,
                                "priority": PRIORITIES[i % 3]} for i in range(N_MANY)])
    system.wait_final(N_MANY, 90)

    rows = system.tasks()
    assert sorted(rows) == sorted(ids)
    not_ok = [r for r in rows.values() if r.status != "SUCCESS" or r.attempt != 1]
    assert not not_ok, (f"{len(not_ok)} tasks not SUCCESS at attempt 1, e.g. {not_ok[:3]}\n"
                        f"{system.tails()}")
    runs = log.by_task()
    twice = {t: r for t, r in runs.items() if len(r) != 1}
    assert set(runs) == set(ids) and not twice, f"ran more than once: {list(twice.items())[:3]}"
    # when each processor really started (its own clock), not started_at: a task staged
    # ahead is fenced early and its started_at is its trigger time by construction
    started = [run for task_runs in runs.values() for run in task_runs]
    early = [r for r in started if r.start < r.trigger - CLOCK_TOLERANCE_MS]
    assert not early, f"{len(early)} tasks started before their trigger time: {early[:3]}"
    assert all(r.started_at >= r.trigger_time for r in rows.values())
    by_worker = {w.name: sum(r.owner_node == w.name for r in rows.values()) for w in workers}
    assert all(by_worker.values()), f"a worker got no work: {by_worker}"
    late = [r.start - r.trigger for r in started]
    print(f"\n{N_MANY} tasks, 2 schedulers + 2 workers: start - trigger p50 {pct(late, 50)} ms, "
          f"p99 {pct(late, 99)} ms, max {max(late)} ms; per worker {by_worker}")


# -- b. retries with backoff --------------------------------------------------------------------

BASE_MS, JITTER = 400, 0.5
BACKOFF = {"retry_backoff_base_ms": BASE_MS, "retry_backoff_max_ms": 10_000,
           "retry_backoff_jitter": JITTER}
#: how late a retry may start after its new trigger time: the worker's retry write wakes the
#: schedulers (NOTIFY; SQLite polls every 50 ms), so it is loaded at once, not at the next
#: periodic preload (1 s later)
RETRY_PICKUP_MS = 250
#: from a run's start to its result being timed (the run itself raises at once)
RUN_MS = 100


def backoff_bounds(retry_count: int) -> tuple[int, int]:
    """[shortest, longest] wait before retry ``retry_count`` (0-based) under BACKOFF."""
    ceiling = BASE_MS << retry_count  # far below retry_backoff_max_ms
    return int(ceiling * (1 - JITTER)), ceiling


def check_backoff(runs: list[Run]) -> list[int]:
    """Assert each retry in ``runs`` came after its failure as BACKOFF says; returns the
    waits (failure start → retry trigger time)."""
    waits = []
    for n, (failed, retried) in enumerate(itertools.pairwise(runs)):
        lo, hi = backoff_bounds(n)
        wait = retried.trigger - failed.start  # the retry's trigger = failure + backoff(n)
        assert lo - CLOCK_TOLERANCE_MS <= wait <= hi + RUN_MS, (n, wait, (lo, hi), runs)
        late = retried.start - retried.trigger
        assert -CLOCK_TOLERANCE_MS <= late <= RETRY_PICKUP_MS, (n, late, runs)  # never early
        assert lo - CLOCK_TOLERANCE_MS <= retried.start - failed.start \
            <= hi + RUN_MS + RETRY_PICKUP_MS, (n, runs)
        waits.append(wait)
    return waits


@pytest.mark.e2e
@pytest.mark.integration
@pytest.mark.timeout(90)
def test_failing_twice_then_succeeding_retries_with_backoff(redis_system: System,
                                                            tmp_path: Path) -> None:
    system = redis_system
    log = Ledger(tmp_path / "runs.jsonl")
    system.env = BACKOFF
    system.scheduler("sched-0")
    system.worker("worker-0")
    system.wait_ready()
    ids = system.enqueue_many([{**_task(log, i, fail=2), "delay": 0.5, "max_retry": 3,
                                "priority": PRIORITIES[i % 3]} for i in range(6)])
    system.wait_final(len(ids), 60)
    rows, runs = system.tasks(), log.by_task()
    waits = []
    for task_id in ids:
        row, task_runs = rows[task_id], runs.get(task_id, [])
        assert (row.status, row.retry_count, row.attempt) == ("SUCCESS", 2, 3), row
        assert row.last_error == "RuntimeError: planned failure #2"
        assert [(r.attempt, r.retry) for r in task_runs] == [(1, 0), (2, 1), (3, 2)], task_runs
        waits += check_backoff(task_runs)
        print(f"task {task_id}: attempts start {[r.start - task_runs[0].start for r in task_runs]}"
              f" ms after the first; lateness {[r.start - r.trigger for r in task_runs]} ms")
    assert len(set(waits)) > 1, f"no jitter in the retry backoff: {waits}"


# -- c. timeouts --------------------------------------------------------------------------------

@pytest.mark.e2e
@pytest.mark.integration
@pytest.mark.timeout(90)
def test_a_task_over_its_timeout_is_signalled_and_never_runs_twice_at_once(
        redis_system: System, tmp_path: Path) -> None:
    system = redis_system
    log = Ledger(tmp_path / "runs.jsonl")
    system.env = BACKOFF
    system.scheduler("sched-0")
    system.worker("worker-0", concurrency="high=2,default=2,slow=1")
    system.wait_ready()
    sleep_s, timeout_ms = 2.0, 400
    final, retried, quick = system.enqueue_many([
        {**_task(log, 0, sleep=sleep_s), "delay": 0.3, "timeout_ms": timeout_ms, "max_retry": 0,
         "priority": "slow"},
        {**_task(log, 1, sleep=sleep_s), "delay": 0.3, "timeout_ms": timeout_ms, "max_retry": 1},
        {**_task(log, 2, sleep=0.1), "delay": 0.3, "timeout_ms": 3000, "max_retry": 0}])
    # the timed-out thread cannot be killed: it keeps its slot ("overdue") until it returns
    system.wait_for(lambda: system.node_info("worker-0").get("overdue", {}).get("slow") == 1,
                    10, "the slow pool reporting its timed-out run as overdue")
    system.wait_final(3, 30)
    system.wait_for(lambda: system.node_info("worker-0").get("overdue", {}).get("slow") == 0,
                    10, "the overdue slot free again once its thread returned")
    rows = system.tasks()
    message = f"timed out after {timeout_ms} ms"
    for task_id, retries in ((final, 0), (retried, 1)):
        row = rows[task_id]
        assert (row.status, row.retry_count, row.last_error) == ("FAILED", retries, message), row
        # recorded when the sleeping thread returned, so no retry could overlap it
        assert row.finished_at - row.started_at >= sleep_s * 1000 - CLOCK_TOLERANCE_MS, row
        runs = log.by_task()[task_id]
        assert [r.attempt for r in runs] == list(range(1, retries + 2))
        for earlier, later in itertools.pairwise(runs):
            assert later.start >= earlier.start + sleep_s * 1000, (earlier, later)
    assert (rows[quick].status, rows[quick].last_error) == ("SUCCESS", None)


# -- d. pool isolation --------------------------------------------------------------------------

@pytest.mark.e2e
@pytest.mark.integration
@pytest.mark.timeout(90)
def test_a_saturated_slow_pool_does_not_delay_high_priority_tasks(redis_system: System,
                                                                  tmp_path: Path) -> None:
    system = redis_system
    log = Ledger(tmp_path / "runs.jsonl")
    system.scheduler("sched-0")
    for i in range(2):
        system.worker(f"worker-{i}", concurrency="high=4,default=4,slow=2")
    slots, slow_s = 2 * 2, 2.0
    system.wait_ready()
    slow = system.enqueue_many([{**_task(log, i, sleep=slow_s), "delay": 0.2, "priority": "slow"}
                                for i in range(3 * slots)])
    # started, by the run log (RUNNING alone may be a task staged before its trigger time)
    # (each worker also stages runs beyond its threads: RUNNING counts them too)
    system.wait_for(lambda: system.statuses()["RUNNING"] >= slots and len(log.runs()) == slots,
                    15, "the slow pools saturated", detail=system.statuses)
    high = system.enqueue_many([{**_task(log, 100 + i), "delay": 0.1 + i / 50,
                                 "priority": "high"} for i in range(40)])
    system.wait_final(len(slow) + len(high), 60)
    rows = system.tasks()
    slow_rows = [rows[i] for i in slow]
    late = []
    for task_id in high:
        row = rows[task_id]
        assert row.status == "SUCCESS", row
        at = row.started_at
        running = sum(s.started_at <= at < s.finished_at for s in slow_rows)
        waiting = sum(s.started_at > at for s in slow_rows)
        # the slow pools were full, with slow work still queued, while this one started …
        assert running == slots and waiting > 0, (row, running, waiting)
        late.append(at - row.trigger_time)
    # … and it started long before a slow slot could have freed up
    assert max(late) < slow_s * 1000 / 4, f"high tasks waited behind slow ones: {sorted(late)}"
    # the slow pools stayed bounded: never more slow tasks at once than slots
    edges = sorted([(s.started_at, 1) for s in slow_rows] + [(s.finished_at, -1)
                                                                for s in slow_rows])
    most = max(itertools.accumulate(step for _, step in edges))
    assert most <= slots, f"{most} slow tasks ran at once on {slots} slots"
    print(f"\nhigh tasks during a saturated slow pool ({slow_s:g} s tasks): start - trigger "
          f"p50 {pct(late, 50)} ms, max {max(late)} ms")


# -- e. a worker killed with SIGKILL mid-task (the embedded default's, below) ------------------

#: short liveness settings, so a dead worker is noticed (3 × 0.5 s) and its tasks recovered
#: within seconds, and what it received but never started is dispatched again after 4 s
RECOVERY = {"heartbeat_interval_s": 0.5, "heartbeat_misses": 3, "ack_timeout_ms": 4000}


def kill_mid_task(system: System, victim: str, log: Ledger, tasks: list[dict[str, Any]],
                  min_running: int, timeout: float = 60) -> dict[str, Any]:
    """Enqueue ``tasks``, SIGKILL ``victim`` once it runs ``min_running`` of them, wait
    until all finish.

    Asserts that nothing was lost and that only tasks RUNNING on the victim when it died
    ran twice; returns what happened.
    """
    daemon = next(d for d in system.daemons if d.name == victim)
    ids = system.enqueue_many(tasks)
    system.wait_for(lambda: len(system.running_on(victim)) >= min_running, 30,
                    f"{victim} running tasks", detail=system.statuses)
    system.kill(daemon)
    # the process is gone: what the database says it was running is frozen until recovery
    running_at_kill = system.running_on(victim)
    assert daemon.proc.returncode == -signal.SIGKILL
    system.wait_final(len(ids), timeout)

    rows, runs = system.tasks(), log.by_task()
    failed = {t: r for t, r in rows.items() if r.status != "SUCCESS"}
    assert not failed, f"{len(failed)} tasks did not succeed: {list(failed.values())[:3]}\n" \
                       f"{system.tails()}"
    assert set(runs) == set(ids), f"{len(set(ids) - set(runs))} tasks never ran"
    planned = {t: json.loads(r.payload).get("fail", 0) for t, r in rows.items()}
    # a run beyond the planned failures is a run twice
    twice = {t for t, r in runs.items() if len(r) > planned[t] + 1}
    summary = (f"{len(twice)} of {len(ids)} tasks ran twice; {len(running_at_kill)} were "
               f"RUNNING on {victim} when it was killed")
    print(f"\nSIGKILL of {victim}: {summary}")
    assert twice <= running_at_kill, f"{summary}; ran twice without being RUNNING on the " \
                                     f"killed worker: {sorted(twice - running_at_kill)}"
    for task_id in twice:
        attempts = [r.attempt for r in runs[task_id]]
        assert attempts == sorted(set(attempts)), (task_id, runs[task_id])  # a new attempt
    # RUNNING on the victim: started there (the ledger says so), or only staged (fenced
    # ahead of a free thread): both recovered elsewhere at a new attempt; a run that started
    # counts a retry, one the worker had listed (ax_kombu.worker.listing) none
    started = {t for t, r in runs.items() if any(run.pid == daemon.proc.pid for run in r)}
    for task_id in running_at_kill:
        row = rows[task_id]
        assert row.attempt >= 2 and row.owner_node != victim, row
    # nothing else was taken for lost (the survivor kept its tasks): each task's retries are
    # its planned failures, plus one if it started on the victim (none more if the run it
    # lost was itself to fail as planned: the recovery stands in for that failure); a staged
    # one not listed counts one too (the safe side), a listed one none
    lost_runs = running_at_kill & started

    def extra(t: int) -> tuple[int, ...]:
        if t in lost_runs:
            return (0, 1) if planned[t] else (1,)
        return (0, 1) if t in running_at_kill else (0,)
    wrong = {t: r.retry_count for t, r in rows.items() if r.retry_count - planned[t] not in extra(t)}
    assert not wrong, f"{summary}; unexpected retry counts: {wrong}"
    lost = {t for t, r in rows.items() if r.last_error == "worker lost"}
    assert {t for t in lost_runs if not planned[t]} <= lost <= running_at_kill, summary
    return {"ids": ids, "twice": twice, "running_at_kill": running_at_kill, "rows": rows}


# -- f. warm shutdown ---------------------------------------------------------------------------

@pytest.mark.e2e
@pytest.mark.integration
@pytest.mark.timeout(120)
def test_sigterm_stops_a_worker_warm_and_loses_nothing(redis_system: System,
                                                       tmp_path: Path) -> None:
    system = redis_system
    log = Ledger(tmp_path / "runs.jsonl")
    system.scheduler("sched-0")
    # the victim also has received-but-unstarted work (prefetch 2 × pool) to give back
    victim = system.worker("worker-0", concurrency="high=2,default=4,slow=2",
                           args=["--prefetch-multiplier", "2"])
    system.worker("worker-1", concurrency="high=2,default=4,slow=2")
    system.wait_ready()
    ids = system.enqueue_many([{**_task(log, i, sleep=0.6), "delay": 0.3 + i / 40}
                               for i in range(60)])
    # (with the claim lead, tasks are RUNNING — fenced, staged — before they start: wait for
    # one the victim has really started)
    system.wait_for(lambda: len(system.running_on(victim.name)) >= 3
                    and system.node_info(victim.name)["backlog"]["default"] > 0
                    and any(r.pid == victim.proc.pid for r in log.runs()), 30,
                    "worker-0 running tasks with more waiting", detail=system.statuses)
    started = {r.task_id for r in log.runs() if r.pid == victim.proc.pid}  # before the next
    running_at_term = system.running_on(victim.name)
    system.signal(victim, signal.SIGTERM)
    code = victim.proc.wait(30)
    assert code == 0, f"warm shutdown exited {code}\n{system.tails()}"
    assert system.node(victim.name).stopped_at is not None
    system.wait_final(len(ids), 60)

    rows, runs = system.tasks(), log.by_task()
    assert {r.status for r in rows.values()} == {"SUCCESS"}, system.statuses()
    # what had started when the signal came was finished by the victim before it exited; a
    # task it had staged (RUNNING before its trigger time, not started) was handed back and
    # ran elsewhere, once (checked below)
    started_at_term = [t for t in running_at_term if t in started]
    assert started_at_term, (running_at_term, started)
    assert all(rows[t].owner_node == victim.name for t in started_at_term)
    twice = {t: r for t, r in runs.items() if len(r) > 1}
    assert set(runs) == set(ids) and not twice, f"ran twice after a warm stop: {twice}"
    handed_back = [line for line in victim.log.read_text().splitlines()
                   if "handed back to READY" in line]
    print(f"\nSIGTERM: worker-0 finished {len(started_at_term)} running tasks (of "
          f"{len(running_at_term)} RUNNING), exit {code}; "
          f"{handed_back or 'nothing unstarted to hand back'}")


# -- g. the embedded default: SQLite store + ax's SQLite broker, no server ----------------------

@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_the_embedded_default_end_to_end(tmp_path: Path) -> None:
    broker = {"broker_url": f"ax+sqlite:///{tmp_path / 'broker.sqlite3'}"}
    system = System(f"sqlite:///{tmp_path / 'ax.sqlite3'}", broker, tmp_path,
                    env={**RECOVERY, **BACKOFF})
    try:
        log = Ledger(tmp_path / "runs.jsonl")
        system.scheduler("sched-0")
        for i in range(2):
            system.worker(f"worker-{i}", concurrency="high=4,default=4,slow=2")
        system.wait_ready()
        quick = [{**_task(log, i), "delay": 0.5 + 2.5 * i / 240, "priority": PRIORITIES[i % 3]}
                 for i in range(240)]
        # retried on the high pool: the sleepy tasks fill the default ones
        flaky = [{**_task(log, 1000 + i, fail=2), "delay": 0.5, "max_retry": 3,
                  "priority": "high"} for i in range(3)]
        sleepy = [{**_task(log, 2000 + i, sleep=1 + (i % 3) / 4), "delay": 0.3 + i / 20,
                   "max_retry": 2} for i in range(24)]
        outcome = kill_mid_task(system, "worker-0", log, quick + flaky + sleepy, min_running=3)
        rows, runs = outcome["rows"], log.by_task()
        ids, recovered = outcome["ids"], outcome["running_at_kill"]
        early = [r for task_runs in runs.values() for r in task_runs
                 if r.start < r.trigger - CLOCK_TOLERANCE_MS]  # each run's own clock
        assert not early, early[:3]
        for task_id in ids[len(quick):len(quick) + len(flaky)]:
            if task_id in recovered:
                continue  # the kill used one of its retries
            row = rows[task_id]
            assert (row.retry_count, row.last_error) == (2, "RuntimeError: planned failure #2")
            check_backoff(runs[task_id])
    finally:
        system.close()
