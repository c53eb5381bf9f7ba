"""Recurring occurrences across the death of a scheduler (issue 22, item 4), in real
processes: two ``ax-scheduler`` and one ``ax-worker`` on PostgreSQL + Redis, four jobs
firing every second (cron ``* * * * * *`` with ``misfire`` ``fire_all``, ``fire_once``
and the default, and ``every=1``); the scheduler that has loaded their upcoming occurrences is
SIGKILLed. The processor (:mod:`tests.e2e.recurring_tasks`) writes one ledger line per
run; from that ledger:

* a plain SIGKILL: every occurrence from one second before the kill to several seconds
  after it runs exactly once, within a bounded time, and each one due after the kill
  starts within ``LATE_BOUND_MS`` of its time, well under the schedulers' silence window
  (10 s here). Before, those of the killed scheduler's share (by task id, whichever
  scheduler wrote them) waited until the survivor stopped counting it live, a silence
  window after its last beat: the survivor read no other share, and took another share's
  overdue tasks only once they were a silence window late. An occurrence that came late
  because its scheduler died is late, not missed: it was written before the kill, so no
  misfire policy drops it, and the job's later occurrences run on time;
* a SIGKILL while the survivor's housekeeping fails (``ax_job`` locked by the test, the
  schedulers on ``lock_timeout=200ms``: every recurring-job pass fails): the occurrences
  the killed node wrote and had loaded still run, each once. Before, the failing step ended
  every housekeeping pass of the survivor before its preload, its beat and its judging,
  and reset its trust in its own beats, so it never declared the dead node dead nor
  released what that node had loaded: they never ran, however long one waited. Once
  the lock goes, the occurrences nobody could write meanwhile go by each job's misfire
  policy, and no occurrence is left undispatched behind.
"""

from __future__ import annotations

import signal
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from ax_kombu.store.engine import make_engine
from ax_kombu.store.preload import Share

from .system import Daemon
from .test_recurring import (
    HEARTBEAT,
    UNDISPATCHED,
    RecurringSystem,
    Tick,
    _drop_jobs,
    brief,
    loader,
    now_ms,
)

#: the jobs: name → schedule() arguments
JOBS: dict[str, dict[str, Any]] = {
    "kill.cron.fire_all": {"cron": "* * * * * *", "misfire": "fire_all"},
    "kill.cron.fire_once": {"cron": "* * * * * *", "misfire": "fire_once"},
    "kill.cron.default": {"cron": "* * * * * *"},
    "kill.every": {"every": 1},
}
#: occurrences watched after the kill (ms)
AFTER_KILL_MS = 6000
#: every watched occurrence has run within this long after the kill (s): a recovery pass
#: and the ack timeout (15 s) of a claim the victim never published
BOUND_S = 15.0
#: the plain SIGKILL's schedulers: a silence window of 10 s (20 beats of 0.5 s), so that
#: waiting for it would show in the starts
KILL_HEARTBEAT = {"heartbeat_interval_s": 0.5, "heartbeat_misses": 20}
#: every occurrence due after the kill starts within this long of its time (ms), unless the
#: victim had claimed it (its next attempt waits for the ack timeout): the survivor takes
#: another share's tasks once overdue by a preload interval plus the claim lead (1.25 s,
#: looked for every second), then by a quarter second; the rest is a margin for a busy host
LATE_BOUND_MS = 3500


@pytest.fixture
def cluster(pg_url: str, redis_broker: dict[str, str], tmp_path: Path) -> Iterator[RecurringSystem]:
    _drop_jobs(pg_url)
    ax = RecurringSystem(pg_url, redis_broker, tmp_path, env={**HEARTBEAT},
                 ledger=tmp_path / "ledger.jsonl")
    yield ax
    ax.close()
    _drop_jobs(pg_url)


@pytest.mark.e2e
@pytest.mark.integration
@pytest.mark.timeout(60)
def test_sigkill_of_the_loaded_scheduler_loses_and_repeats_no_occurrence(
        cluster: RecurringSystem) -> None:
    cluster.env = {**cluster.env, **KILL_HEARTBEAT}
    schedulers = cluster.start(schedulers=2)
    for name, args in JOBS.items():
        cluster.client.schedule(name, "e2e.tick", **args)
    cluster.wait_ticks(lambda ticks: all(len(ticks.get(n, [])) >= 2 for n in JOBS), 20,
                       "every job ran twice")
    victim, loaded = cluster.wait_for(lambda: loader(cluster, schedulers), 10,
                                      "a scheduler has loaded upcoming occurrences")
    cluster.kill(victim)
    kill_at = now_ms()
    assert victim.proc.returncode == -signal.SIGKILL

    expected = {n: cluster.occurrences(n, kill_at - 1000, kill_at + AFTER_KILL_MS)
                for n in JOBS}

    def all_ran(ticks: dict[str, list[Tick]]) -> bool:
        return all(set(expected[n]) <= {t.scheduled_at for t in ticks.get(n, [])}
                   for n in JOBS)

    cluster.wait_ticks(all_ran, AFTER_KILL_MS / 1000 + BOUND_S,
                       f"every occurrence after the SIGKILL of {victim.name} "
                       f"({loaded} loaded) ran")
    cluster.stop()
    survivor = next(d for d in schedulers if d is not victim)
    check_once(cluster, expected, survivor, kill_at)
    check_on_time(cluster, kill_at)


def check_once(cluster: RecurringSystem, expected: dict[str, list[int]], survivor: Daemon,
               kill_at: int) -> None:
    """Each expected occurrence ran exactly once; none ran that is not an occurrence."""
    assert survivor.proc.returncode == 0, f"{survivor.name} did not stop warm\n{cluster.tails()}"
    ledger = cluster.ticks()
    for name, times in expected.items():
        runs = [t for t in ledger.get(name, []) if times[0] <= t.scheduled_at <= times[-1]]
        counts = Counter(t.scheduled_at for t in runs)
        twice = sorted(t for t, n in counts.items() if n > 1)
        missing = sorted(set(times) - set(counts))
        stray = sorted(set(counts) - set(times))
        assert not (twice or missing or stray), (
            f"{name}: killed at {kill_at}; ran twice {twice}, never ran {missing}, not an "
            f"occurrence {stray}\nruns: {brief(runs)}\n{cluster.tails()}")
    late = max(t.started_at - t.scheduled_at for runs in ledger.values() for t in runs
               if t.scheduled_at >= kill_at - 1000)
    print(f"\nSIGKILL of the loaded scheduler: {sum(map(len, expected.values()))} "
          f"occurrences each ran once; latest start {late} ms after its occurrence")


def check_on_time(cluster: RecurringSystem, kill_at: int) -> None:
    """Every occurrence due after the kill started within ``LATE_BOUND_MS``, but those
    the victim had claimed (run at a later attempt, after the ack timeout)."""
    after = [t for runs in cluster.ticks().values() for t in runs
             if t.scheduled_at >= kill_at and t.attempt == 1]
    late = sorted((t for t in after if t.late_ms > LATE_BOUND_MS), key=lambda t: t.scheduled_at)
    assert after and not late, (
        f"killed at {kill_at}: {len(late)} of {len(after)} occurrences due after it started "
        f"more than {LATE_BOUND_MS} ms late: "
        f"{'; '.join(f'{t.job} {brief([t])}' for t in late)}\n{cluster.tails()}")
    print(f"occurrences due after the kill: latest start "
          f"{max(t.late_ms for t in after)} ms after its time")


def _with_lock_timeout(url: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}options=-c%20lock_timeout%3D200"


def _loaded_by(cluster: RecurringSystem, node: str, live: list[str]) -> dict[str, set[int]]:
    """The occurrences in ``node``'s share among the schedulers ``live``, not yet claimed,
    by job."""
    out: dict[str, set[int]] = {}
    for row in cluster.query(f"SELECT job, scheduled_at FROM ax_task WHERE {UNDISPATCHED}"
                             f"{Share.among(live, node).sql()}"):
        out.setdefault(row.job, set()).add(int(row.scheduled_at))
    return out


@pytest.mark.e2e
@pytest.mark.integration
@pytest.mark.timeout(90)
def test_what_a_killed_scheduler_loaded_runs_while_the_survivors_housekeeping_fails(
        cluster: RecurringSystem) -> None:
    cluster.env = {**cluster.env, "database_url": _with_lock_timeout(cluster.database_url)}
    schedulers = cluster.start(schedulers=2)
    for name, args in JOBS.items():
        cluster.client.schedule(name, "e2e.tick", **args)
    cluster.wait_ticks(lambda ticks: all(len(ticks.get(n, [])) >= 2 for n in JOBS), 20,
                       "every job ran twice")
    locker = make_engine(cluster.database_url).connect()
    try:
        tx = locker.begin()
        # the job rows are left alone by a pass that waits for its lock: take it first
        locker.execute(text("LOCK TABLE ax_job IN ACCESS EXCLUSIVE MODE"))
        victim, _count = cluster.wait_for(lambda: loader(cluster, schedulers), 10,
                                          "a scheduler has loaded upcoming occurrences")
        cluster.kill(victim)
        kill_at = now_ms()
        loaded = _loaded_by(cluster, victim.name, [d.name for d in schedulers])
        assert loaded, "the killed scheduler had loaded nothing"

        def loaded_ran(ticks: dict[str, list[Tick]]) -> bool:
            return all(times <= {t.scheduled_at for t in ticks.get(job, [])}
                       for job, times in loaded.items())

        cluster.wait_ticks(loaded_ran, BOUND_S, f"the occurrences {victim.name} had loaded ran "
                           f"while the job table was locked: {loaded}")
        ran_at = now_ms()
        tx.rollback()
    finally:
        locker.close()
        locker.engine.dispose()
    released_at = now_ms()
    cluster.wait_ticks(lambda ticks: all(any(t.scheduled_at >= released_at + 2000
                                             for t in ticks.get(n, [])) for n in JOBS),
                       BOUND_S, "every job fired on time again after the lock")

    def left() -> list[Any]:
        return cluster.query("SELECT job, scheduled_at, status FROM ax_task WHERE job IS NOT "
                             "NULL AND status IN ('CREATED', 'DELAYED', 'READY', 'DISPATCHING') "
                             "AND scheduled_at < :t", t=released_at)

    # an occurrence the victim had claimed but not published when killed stays DISPATCHING
    # until its ack timeout (15 s after the claim) sends it again: wait for it, not past it
    cluster.wait_for(lambda: not left(), BOUND_S,
                     "no occurrence from before the lock's release left undispatched",
                     detail=left)
    cluster.stop()
    ledger = cluster.ticks()
    for job, times in loaded.items():
        runs = Counter(t.scheduled_at for t in ledger.get(job, []) if t.scheduled_at in times)
        assert all(runs[t] == 1 for t in times), f"{job}: loaded {sorted(times)}, ran {runs}"
    twice = {job: [t for t, n in Counter(x.scheduled_at for x in ticks).items() if n > 1]
             for job, ticks in ledger.items()}
    assert not any(twice.values()), f"ran twice: {twice}\n{cluster.tails()}"
    print(f"\nSIGKILL of {victim.name} with {sum(map(len, loaded.values()))} occurrences loaded "
          f"while ax_job was locked: all ran once, the last {(ran_at - kill_at) / 1000:.1f} s "
          f"after the kill")
