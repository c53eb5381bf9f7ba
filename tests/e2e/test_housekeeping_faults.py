"""A failing housekeeping step stops neither the heartbeat nor the process (issue 22, item 3),
in real processes: two ``ax-scheduler`` (each with ``lock_timeout=200ms`` on its database
connections and its ``/metrics`` served) and one ``ax-worker`` on PostgreSQL + Redis.

Two faults, both made of real database state:

* a recurring job row no scheduler can plan (``every_ms = 0``, written past
  ``ax.schedule``'s checks): before, planning it raised ``ZeroDivisionError`` on the
  housekeeper's thread and every scheduler exited 70 at once; now it is marked broken
  with the reason, and the other jobs go on;
* the ``ax_job`` table locked ``ACCESS EXCLUSIVE`` by the test's own transaction for
  several silence windows: every recurring-job pass fails with a lock timeout. Before,
  the heartbeat shared the housekeeper's thread, so no beat was written, nothing was
  preloaded (ordinary tasks did not run) and the nodes would be declared dead; now each
  scheduler's ``ax_node`` heartbeat advances under the same incarnation, ordinary tasks
  run on time, ``ax_housekeeping_errors_total{step="jobs"}`` rises, nobody is fenced,
  and once the lock is gone the recurring jobs run again.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from ax_kombu.store.engine import make_engine

from ..ledger import Ledger
from .system import Daemon, System, stop_all
from .test_metrics_scrape import free_port, total, try_scrape

#: a dead node is noticed after 0.5 s x 3 silent beats
ENV = {"heartbeat_interval_s": 0.5, "heartbeat_misses": 3, "recovery_interval_s": 1}
SILENCE_MS = 1500
#: how long the job table stays locked: several silence windows
LOCK_MS = 5000


@pytest.fixture
def system(pg_url: str, redis_broker: dict[str, str], tmp_path: Path) -> Iterator[System]:
    _drop_jobs(pg_url)
    ax = System(pg_url, redis_broker, tmp_path, env=ENV)
    yield ax
    ax.close()
    _drop_jobs(pg_url)


def _drop_jobs(url: str) -> None:
    engine = make_engine(url)
    with engine.begin() as conn:
        conn.execute(text("DELETE FROM ax_job"))
    engine.dispose()


def _with_lock_timeout(url: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}options=-c%20lock_timeout%3D200"


def _insert_unplannable_job(system: System, name: str) -> None:
    """A job row ``ax.schedule`` would refuse: an interval of 0 ms."""
    now = int(time.time() * 1000)
    with system.reader.begin() as conn:
        conn.execute(text(
            "INSERT INTO ax_job (name, task_type, payload, every_ms, tz, misfire, strategy, "
            "priority, max_retry, timeout_ms, processor_name, paused, anchor_ms, "
            "next_fire_at, spec, created_at, updated_at) VALUES (:n, 'e2e.task', 'null', 0, "
            "'UTC', 'fire_once', 'parallel', 'default', 0, 60000, 'e2e.task', false, :now, "
            ":now, 'x', :now, :now)"), {"n": name, "now": now})


def _beat(system: System, name: str) -> tuple[int, int]:
    row = system.node(name)
    assert row is not None and row.stopped_at is None, f"{name}: {row}\n{system.tails()}"
    return int(row.heartbeat_at), int(row.incarnation)


def _job_errors(port: int) -> float:
    samples = try_scrape(port)
    return -1.0 if samples is None else total(samples, "ax_housekeeping_errors_total",
                                              step="jobs")


def _fenced(port: int) -> float:
    samples = try_scrape(port)
    return -1.0 if samples is None else total(samples, "ax_node_fenced_total")


@pytest.mark.e2e
@pytest.mark.integration
@pytest.mark.timeout(90)
def test_a_failing_housekeeping_step_stops_neither_beats_nor_tasks(system: System,
                                                                     tmp_path: Path) -> None:
    ports = {"s0": free_port(), "s1": free_port()}
    schedulers = [system.scheduler(name, env={"database_url": _with_lock_timeout(
        system.database_url), "metrics_port": port}) for name, port in ports.items()]
    system.worker("w0")
    system.wait_ready()
    ticks = Ledger(tmp_path / "ticks.jsonl")
    system.client.schedule("hk.good", "e2e.task", {"log": str(ticks)}, every=1)
    _insert_unplannable_job(system, "hk.unplannable")

    # the unplannable job is marked broken, with the reason; the good one runs
    system.wait_for(lambda: _broken(system, "hk.unplannable"), 10, "the job marked broken")
    system.wait_for(lambda: len(ticks.runs()) >= 2, 10, "the good job ran twice")
    reason = _broken(system, "hk.unplannable")
    assert "every must be between 1 second" in reason, reason
    assert all(d.alive for d in schedulers), system.tails()

    before = {name: _beat(system, name) for name in ports}
    errors_before = {name: _job_errors(port) for name, port in ports.items()}
    log = Ledger(tmp_path / "runs.jsonl")
    locker = make_engine(system.database_url).connect()
    try:
        tx = locker.begin()
        locker.execute(text("LOCK TABLE ax_job IN ACCESS EXCLUSIVE MODE"))
        locked_at = int(time.time() * 1000)
        # ordinary tasks due during the lock run, on time
        ids = {int(t) for t in system.enqueue_many(
            [{"task_type": "e2e.task", "payload": {"log": str(log), "i": i},
              "delay": 0.3 + 0.1 * i} for i in range(20)])}
        system.wait_for(lambda: len(log.runs()) >= len(ids), 15, "the 20 tasks ran",
                        detail=system.statuses)
        # the beats go on for several silence windows under the same incarnation
        system.wait_for(lambda: all(_beat(system, n)[0] >= locked_at + LOCK_MS for n in ports),
                        LOCK_MS / 1000 + 10, "both schedulers beat through the lock")
        during = {name: _beat(system, name) for name in ports}
        errors_during = {name: _job_errors(port) for name, port in ports.items()}
        fenced = {name: _fenced(port) for name, port in ports.items()}
        tx.rollback()
    finally:
        locker.close()
        locker.engine.dispose()

    for name in ports:
        assert during[name][1] == before[name][1], (
            f"{name} re-registered (fenced) during the lock\n{system.tails()}")
        assert errors_during[name] > max(errors_before[name], 0), (
            f"{name}: ax_housekeeping_errors_total{{step='jobs'}} did not rise: "
            f"{errors_before[name]} -> {errors_during[name]}\n{system.tails()}")
        assert fenced[name] == 0, f"{name} was fenced {fenced[name]} times\n{system.tails()}"
    assert all(d.alive for d in schedulers), system.tails()
    statuses = {r.status for r in system.tasks().values() if r.task_id in ids}
    assert statuses == {"SUCCESS"}, statuses
    late = sorted(r.start - r.trigger for r in log.runs())
    assert len(late) == len(ids) and late[-1] < SILENCE_MS, f"late by {late} ms"
    print(f"\nax_job locked {LOCK_MS / 1000:g} s: beats went on (incarnations unchanged), "
          f"jobs-step errors {errors_before} -> {errors_during}, 20 tasks due meanwhile "
          f"started {late[len(late) // 2]} ms (p50) / {late[-1]} ms (max) after their trigger")

    # the lock gone, the recurring job runs again
    released_at = int(time.time() * 1000)
    system.wait_for(lambda: any(r.start > released_at for r in ticks.runs()), 10,
                    "the good job ran after the lock")
    assert all(d.alive for d in schedulers), system.tails()
    _stopped_warm(system, schedulers)


def _broken(system: System, name: str) -> Any:
    rows = system.query("SELECT broken FROM ax_job WHERE name = :n", n=name)
    return rows[0].broken if rows else None


def _stopped_warm(system: System, schedulers: list[Daemon]) -> None:
    stop_all([d.proc for d in schedulers])
    codes = {d.name: d.proc.returncode for d in schedulers}
    assert set(codes.values()) == {0}, f"exit codes {codes}\n{system.tails()}"
