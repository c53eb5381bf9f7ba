"""Recurring jobs in real processes: two ``ax-scheduler`` and one ``ax-worker`` on
PostgreSQL + Redis, then the embedded default. The processor
(:mod:`tests.e2e.recurring_tasks`) appends a ledger line per run; the assertions are on
that ledger (what really ran, how often, how late) and on the ``ax_task`` rows:

* a 1-second job, as ``every=1`` and as cron ``* * * * * *``, six of each for 10 s: exactly
  one run per occurrence, none missed, start − scheduled_at p99 ≤ 50 ms (the product target);
* the same across the SIGKILL of a scheduler is tests/e2e/test_recurring_kill.py's (the
  scheduler that has loaded the upcoming occurrences is killed);
* the embedded default (SQLite store + ``ax+sqlite://``, no settings at all): a
  1-second job for 5 s, exactly one run per occurrence;
* misfires: both schedulers down ≥ 5 s, then back; ``fire_once`` runs one catch-up,
  ``skip`` none, ``fire_all`` every missed occurrence once; what a policy drops is never
  created or CANCELLED with a "misfire" reason.

Every wait polls against a deadline; a failure shows each daemon's log tail.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from ax_kombu.core import cron
from ax_kombu.scheduler.recurrence import ON_TIME_MS
from ax_kombu.store.engine import make_engine
from ax_kombu.store.preload import Share

from .recurring_tasks import LEDGER_ENV
from .system import CLOCK_TOLERANCE_MS, REPO, Daemon, System, pct, stop_all

MODULE = "tests.e2e.recurring_tasks"
#: how long the 1-second jobs are watched (ms of occurrences after their creation)
WINDOW_MS = 10_000
#: the same on the embedded default (one job: exactly once per occurrence, not a percentile)
EMBEDDED_WINDOW_MS = 5_000
#: the product target for start − scheduled_at, 99th percentile (ms): printed, not asserted
#: (speed is measured by benchmarks; on a loaded 2-core CI machine a pause of a few hundred
#: ms is noise, not a bug)
TARGET_P99_MS = 50
#: what is asserted: no occurrence waits for a later pass (a materialiser or preload that
#: missed it costs ≥ 1 s, the preload period)
LATE_BOUND_MS = 1000
#: how long both schedulers stay down in the misfire test (s)
OUTAGE_S = 5.0
#: a dead scheduler is noticed after 0.5 s × 3 missed beats
HEARTBEAT = {"heartbeat_interval_s": 0.5, "heartbeat_misses": 3}
POLICIES = ("fire_once", "skip", "fire_all")


def now_ms() -> int:
    return time.time_ns() // 1_000_000


# -- the ledger ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tick:
    """One run of ``e2e.tick``, as the processor recorded it."""

    job: str
    scheduled_at: int
    trigger_time: int
    task_id: int
    attempt: int
    started_at: int
    pid: int

    @property
    def late_ms(self) -> int:
        return self.started_at - self.scheduled_at

    @property
    def catch_up(self) -> bool:
        """A catch-up run after a misfire triggers at the pass time, not at its occurrence."""
        return self.trigger_time != self.scheduled_at


def read_ledger(path: Path) -> dict[str, list[Tick]]:
    """Every run so far, by job, in occurrence order (a last line still being written
    is left for the next read)."""
    try:
        lines = path.read_text().split("\n")[:-1]
    except FileNotFoundError:
        return {}
    out: dict[str, list[Tick]] = defaultdict(list)
    for line in lines:
        if line.strip():
            tick = Tick(**json.loads(line))
            out[tick.job].append(tick)
    for ticks in out.values():
        ticks.sort(key=lambda t: (t.scheduled_at, t.started_at))
    return dict(out)


def brief(ticks: list[Tick]) -> str:
    return ", ".join(f"{t.scheduled_at % 100_000}(trig {t.trigger_time - t.scheduled_at:+d}, "
                     f"start {t.late_ms:+d}, a{t.attempt})" for t in ticks)


def lateness(ticks: list[Tick]) -> str:
    late = [t.late_ms for t in ticks]
    return (f"n={len(late)} p50 {pct(late, 50)} ms, p99 {pct(late, 99)} ms, "
            f"max {max(late)} ms, sorted {sorted(late)}")


# -- the system ----------------------------------------------------------------------------------


@dataclass
class RecurringSystem(System):
    """A :class:`System` whose daemons know the ledger file; ``bare``: with no ``AX_*``
    setting at all (the embedded defaults, in ``tmp``)."""

    ledger: Path = Path("ledger.jsonl")
    bare: bool = False

    def daemon_env(self, extra: Mapping[str, Any] | None = None) -> dict[str, str]:
        if self.bare:
            env = {k: v for k, v in os.environ.items() if not k.startswith("AX_")}
            env["AX_WORKER_PROCESSES"] = "1"
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(REPO), env.get("PYTHONPATH")) if p)
        else:
            env = super().daemon_env(extra)
        env[LEDGER_ENV] = str(self.ledger)
        return env

    def start(self, schedulers: int) -> list[Daemon]:
        """``schedulers`` schedulers and one worker, registered."""
        started = [self.scheduler(f"sched-{i}") for i in range(schedulers)]
        self.worker("worker-0", args=("-A", MODULE))
        self.wait_ready()
        return started

    def stop(self) -> None:
        """Warm-stop every daemon, so the ledger is complete."""
        stop_all([d.proc for d in self.daemons])

    def ticks(self) -> dict[str, list[Tick]]:
        return read_ledger(self.ledger)

    def summary(self) -> str:
        return "; ".join(f"{job}: {len(ticks)} runs, last {ticks[-1].scheduled_at}"
                         for job, ticks in self.ticks().items()) or "no run yet"

    def wait_ticks(self, check: Callable[[dict[str, list[Tick]]], bool], timeout: float,
                   what: str) -> None:
        self.wait_for(lambda: check(self.ticks()), timeout, what, detail=self.summary)

    def job(self, name: str) -> Any:
        return self.query("SELECT * FROM ax_job WHERE name = :n", n=name)[0]

    def occurrences(self, name: str, after: int, until: int) -> list[int]:
        """The job's occurrences in ``(after, until]``, from its stored schedule."""
        row = self.job(name)
        schedule = cron.make_schedule(row.cron, row.every_ms, row.tz, row.anchor_ms)
        out: list[int] = []
        t = schedule.next_after(after)
        while t is not None and t <= until:
            out.append(t)
            t = schedule.next_after(t)
        return out

    def occurrence_rows(self, name: str) -> dict[int, Any]:
        """The job's tasks, by occurrence time."""
        return {r.scheduled_at: r for r in self.query(
            "SELECT * FROM ax_task WHERE job = :n", n=name)}


def _drop_jobs(url: str) -> None:
    """The shared ``pg_url`` fixture empties ax_task and ax_node, not ax_job: a job left
    behind would keep firing into the next test's schedulers."""
    engine = make_engine(url)
    with engine.begin() as conn:
        conn.execute(text("DELETE FROM ax_job"))
    engine.dispose()


@pytest.fixture
def cluster(pg_url: str, redis_broker: dict[str, str],
            tmp_path: Path) -> Iterator[RecurringSystem]:
    _drop_jobs(pg_url)
    ax = RecurringSystem(pg_url, redis_broker, tmp_path, env=HEARTBEAT,
                         ledger=tmp_path / "ledger.jsonl")
    yield ax
    ax.close()
    _drop_jobs(pg_url)


# -- exactly one run per occurrence --------------------------------------------------------------


def schedule_ticks(cluster: RecurringSystem, pairs: int = 1) -> list[str]:
    """The 1-second job ``2 × pairs`` times: as an interval and as a 6-field cron expression."""
    names = []
    for i in range(pairs):
        suffix = f".{i}" if i else ""
        cluster.client.schedule(f"e2e.tick{suffix}", "e2e.tick", every=1)
        cluster.client.schedule(f"e2e.cron{suffix}", "e2e.tick", cron="* * * * * *")
        names += [f"e2e.tick{suffix}", f"e2e.cron{suffix}"]
    return names


def watch(cluster: RecurringSystem, names: list[str], window_ms: int) -> dict[str, int]:
    """Until every occurrence of ``names`` in their first ``window_ms`` has run, then stop
    the cluster; returns each job's last watched occurrence time."""
    ends = {n: cluster.job(n).created_at + window_ms for n in names}
    expected = {n: cluster.occurrences(n, cluster.job(n).created_at, ends[n]) for n in names}

    def all_ran(ticks: dict[str, list[Tick]]) -> bool:
        return all({t.scheduled_at for t in ticks.get(n, [])} >= set(expected[n])
                   for n in names)

    cluster.wait_ticks(all_ran, window_ms / 1000 + 30, f"every occurrence of {names} ran")
    cluster.stop()
    return ends


def assert_once_each(cluster: RecurringSystem, name: str, ticks: list[Tick],
                     end: int) -> list[Tick]:
    """Exactly one run per occurrence from the job's creation to ``end``; returns those runs."""
    job = cluster.job(name)
    expected = cluster.occurrences(name, job.created_at, end)
    watched = [t for t in ticks if t.scheduled_at <= end]
    counts = Counter(t.scheduled_at for t in watched)
    twice = sorted(t for t, n in counts.items() if n > 1)
    missing = sorted(set(expected) - set(counts))
    stray = sorted(set(counts) - set(expected))
    assert not (twice or missing or stray), (
        f"{name}: {len(expected)} occurrences expected, {len(watched)} runs; ran twice "
        f"{twice}, never ran {missing}, not an occurrence {stray}\n"
        f"runs: {brief(watched)}\n{cluster.tails()}")
    assert len(expected) >= (end - job.created_at) // 1000 - 1, "too few occurrences watched"
    return watched


def steady(cluster: RecurringSystem, name: str, ticks: list[Tick]) -> list[Tick]:
    """The runs whose occurrence the materialiser could write ahead: an occurrence due
    within ``job_lookahead_ms`` of the job's creation is written by the first pass after
    ``schedule()``, up to ``job_interval_ms`` later than it would be in steady state (the
    cron job's first second may be a few ms after its creation)."""
    first = cluster.job(name).created_at + cluster.settings.job_lookahead_ms
    return [t for t in ticks if t.scheduled_at >= first]


@pytest.mark.e2e
@pytest.mark.integration
@pytest.mark.timeout(90)
def test_one_second_jobs_run_once_per_occurrence_on_time(cluster: RecurringSystem) -> None:
    cluster.start(schedulers=2)
    # six pairs: ~100 timed runs, so the p99 is a percentile, not the single slowest run
    names = schedule_ticks(cluster, pairs=6)
    ends = watch(cluster, names, WINDOW_MS)

    ledger, timed, dispatched = cluster.ticks(), [], {}
    for name in names:
        runs = assert_once_each(cluster, name, ledger.get(name, []), ends[name])
        rows = cluster.occurrence_rows(name)
        dispatched.update({t: rows[t.scheduled_at].dispatched_at for t in runs})
        not_once = [(t.scheduled_at, rows[t.scheduled_at].status, rows[t.scheduled_at].attempt)
                    for t in runs if (rows[t.scheduled_at].status,
                                      rows[t.scheduled_at].attempt) != ("SUCCESS", 1)]
        assert not not_once, f"{name}: not SUCCESS at attempt 1: {not_once}"
        early = [t for t in runs if t.late_ms < -CLOCK_TOLERANCE_MS]
        assert not early, f"{name}: started before the occurrence: {brief(early)}"
        timed += steady(cluster, name, runs)
    late = [t.late_ms for t in timed]
    # the slowest runs, with when their claim was written (dispatched_at: the scheduler's
    # side, claim_lead_ms before the occurrence when on time) and when they started
    slowest = [(t.job, t.scheduled_at, f"claimed {dispatched[t] - t.scheduled_at:+d}",
                f"started {t.late_ms:+d}") for t in sorted(timed, key=lambda t: -t.late_ms)[:5]]
    print(f"\n1-second jobs (every=1, cron '* * * * * *'), 2 schedulers + 1 worker, "
          f"{WINDOW_MS // 1000} s: start - scheduled_at {lateness(timed)}; slowest {slowest}")
    if pct(late, 99) > TARGET_P99_MS:
        print(f"(over the {TARGET_P99_MS} ms target: a loaded machine, or a regression the "
              "benchmarks would show)")
    assert max(late) < LATE_BOUND_MS, (
        f"an occurrence started {max(late)} ms late: {lateness(timed)}"
        f"\nslowest: {slowest}")


def loader(cluster: RecurringSystem, schedulers: list[Daemon]) -> tuple[Daemon, int] | None:
    """The scheduler whose share (:class:`ax_kombu.store.preload.Share`) has the most
    undispatched occurrences, if any has one."""
    live = [d.name for d in schedulers]
    counts = [(int(cluster.query(f"SELECT COUNT(*) FROM ax_task WHERE {UNDISPATCHED}"
                                 f"{Share.among(live, d.name).sql()}")[0][0]), d)
              for d in schedulers]
    count, busiest = max(counts, key=lambda c: c[0])
    return (busiest, count) if count else None


#: an occurrence written and not yet claimed (nor parked by its job's strategy)
UNDISPATCHED = ("job IS NOT NULL AND status IN ('DELAYED', 'READY') "
                "AND NOT parked")


# -- the embedded default ------------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.timeout(60)
def test_one_second_job_on_the_embedded_default(tmp_path: Path) -> None:
    # the daemons get no AX_* setting and run in tmp_path: they use the default
    # sqlite:///ax.sqlite3 store and ax+sqlite:///ax-broker.sqlite3 broker there, which
    # this client opens by their full paths
    cluster = RecurringSystem(f"sqlite:///{tmp_path / 'ax.sqlite3'}",
                              {"broker_url": f"ax+sqlite:///{tmp_path / 'ax-broker.sqlite3'}"},
                              tmp_path, ledger=tmp_path / "ledger.jsonl", bare=True)
    try:
        cluster.start(schedulers=1)
        cluster.client.schedule("e2e.tick", "e2e.tick", every=1)
        ends = watch(cluster, ["e2e.tick"], EMBEDDED_WINDOW_MS)
        runs = assert_once_each(cluster, "e2e.tick", cluster.ticks().get("e2e.tick", []),
                                ends["e2e.tick"])
        assert (tmp_path / "ax-broker.sqlite3").exists()
        print(f"\nembedded default, 1 scheduler + 1 worker, {EMBEDDED_WINDOW_MS // 1000} s: "
              f"start - scheduled_at "
              f"{lateness(steady(cluster, 'e2e.tick', runs))}")
    finally:
        cluster.close()


# -- misfires ------------------------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.integration
@pytest.mark.timeout(120)
def test_misfire_policies_after_both_schedulers_were_down(cluster: RecurringSystem) -> None:
    schedulers = cluster.start(schedulers=2)
    names = {policy: f"e2e.misfire.{policy}" for policy in POLICIES}
    for policy, name in names.items():
        cluster.client.schedule(name, "e2e.tick", every=1, misfire=policy)
    cluster.wait_ticks(lambda ticks: all(len(ticks.get(n, [])) >= 3 for n in names.values()),
                       20, "every job ran three times")

    stop_all([d.proc for d in schedulers])
    assert [d.proc.returncode for d in schedulers] == [0, 0], cluster.tails()
    down_at = now_ms()
    while now_ms() < down_at + OUTAGE_S * 1000:  # the outage itself: wall-clock time
        time.sleep(0.05)
    restart_at = now_ms()
    for d in schedulers:
        cluster.scheduler(d.name)
    resumed = restart_at + 3000  # a few on-time runs after the restart
    cluster.wait_ticks(lambda ticks: all(
        any(t.scheduled_at >= resumed and not t.catch_up for t in ticks.get(n, []))
        for n in names.values()), 30, "normal firing resumed")
    cluster.stop()

    ledger = cluster.ticks()
    print(f"\nboth schedulers down {(restart_at - down_at) / 1000:.1f} s:")
    for policy, name in names.items():
        check_misfire(cluster, policy, name, ledger.get(name, []), restart_at)


def check_misfire(cluster: RecurringSystem, policy: str, name: str, ticks: list[Tick],
                  restart_at: int) -> None:
    """Assert what the policy promises for the occurrences the outage missed; print the
    figures."""
    rows = cluster.occurrence_rows(name)
    # the restarted cluster's first pass over the job (database time): it wrote the
    # catch-ups (triggering then) and the next occurrences, all created at that instant
    restart_pass = min(r.created_at for r in rows.values() if r.created_at >= restart_at)
    last_before = max(t.scheduled_at for t in ticks if t.started_at < restart_at)
    gap = cluster.occurrences(name, last_before, restart_pass)
    # An occurrence due less than ON_TIME_MS before that pass is late, not missed: the
    # pass writes it as usual (trigger = scheduled_at) and it runs at once. Only those
    # before the cutoff are missed and go by the policy. With a 1 s interval that is
    # the last occurrence of the gap, or none.
    cutoff = restart_pass - ON_TIME_MS
    missed = [t for t in gap if t < cutoff]
    late = [t for t in gap if t >= cutoff]
    context = (f"{policy}: restart pass {restart_pass}, missed {missed}, late {late}\n"
               f"runs: {brief(ticks)}\n{cluster.tails()}")
    assert len(missed) >= 3, f"the outage was too short to be a misfire; {context}"

    counts = Counter(t.scheduled_at for t in ticks)
    assert all(n == 1 for n in counts.values()), f"an occurrence ran twice; {context}"
    catch_ups = [t for t in ticks if t.catch_up]
    # catch-ups trigger at the restart pass, 1 ms apart in occurrence order (oldest first)
    ordered = sorted(catch_ups, key=lambda t: t.scheduled_at)
    assert [t.trigger_time for t in ordered] == [restart_pass + i for i in range(len(ordered))], \
        f"the catch-ups did not trigger at the restart pass, oldest first; {context}"
    assert all(counts[t] == 1 and not by_time(ticks, t).catch_up for t in late), \
        f"a late occurrence did not run once, normally; {context}"

    kept = {"fire_once": missed[-1:], "skip": [], "fire_all": missed}[policy]
    ran_missed = sorted(t for t in missed if t in counts)
    assert ran_missed == kept, f"missed occurrences that ran: {ran_missed}; {context}"
    dropped = [t for t in missed if t not in kept]
    never_created = [t for t in dropped if t not in rows]
    cancelled = [t for t in dropped if t in rows and rows[t].status == "CANCELLED"
                 and "misfire" in (rows[t].last_error or "")]
    assert len(never_created) + len(cancelled) == len(dropped), (
        f"dropped occurrences neither absent nor CANCELLED for a misfire: "
        f"{[(t, rows[t].status, rows[t].last_error) for t in dropped if t in rows]}; {context}")

    everything = cluster.occurrences(name, ticks[0].scheduled_at - 1, ticks[-1].scheduled_at)
    assert sorted(counts) == sorted(set(everything) - set(dropped)), \
        f"the occurrences that ran are not contiguous but for those dropped; {context}"
    print(f"  {policy}: {len(missed)} missed, {len(late)} late, {len(catch_ups)} catch-up "
          f"runs, {len(cancelled)} cancelled, {len(never_created)} never created; "
          f"{len(ticks)} runs")
    # a catch-up is told by its trigger time, the pass time (ctx.scheduled_at's contract:
    # "the trigger time of a catch-up run after a misfire is later"); checked last, so a
    # failure here comes after every other promise was checked
    plain = [t for t in ticks if t.scheduled_at in kept and not t.catch_up]
    assert len(catch_ups) == len(kept), (
        f"{len(catch_ups)} catch-up runs ({brief(catch_ups)}), expected {len(kept)}; missed "
        f"occurrences that ran with trigger_time == scheduled_at: {brief(plain)}; {context}")


def by_time(ticks: list[Tick], scheduled_at: int) -> Tick:
    return next(t for t in ticks if t.scheduled_at == scheduled_at)
