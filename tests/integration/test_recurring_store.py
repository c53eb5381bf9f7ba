"""Recurring jobs on both stores, without daemons: ``schedule()`` as an upsert, the
materialiser's passes on an injected clock (``Materialiser.run(now_ms)``), one task per
occurrence (also between two schedulers racing), misfire policies after an outage,
pause/resume/unschedule, dedup, and bad input.

Client calls run on the store's real clock, so each test takes ``A`` (the job's anchor, read
from its row) as its origin and passes the materialiser times from there on. With the default
``job_lookahead_ms`` (2000) a pass at ``now`` writes the occurrences up to ``now + 2000``.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Row, delete, select, text

from ax_kombu.api import Client, TaskView
from ax_kombu.config import Settings, from_env
from ax_kombu.core.ids import ReservedIds
from ax_kombu.core.states import Status
from ax_kombu.exceptions import JobNotFound, ValidationError
from ax_kombu.recurring import build_job, schedule_job
from ax_kombu.scheduler.recurrence import ON_TIME_MS, Materialiser
from ax_kombu.store import Store, claims, transitions
from ax_kombu.store import jobs as job_store
from ax_kombu.store.leases import StoreReserver
from ax_kombu.store.schema import jobs, tasks

STEP = 250  # the housekeeper's default job_interval_ms


class Scheduler:
    """The materialiser of one scheduler, built as ax_kombu/scheduler/node.py builds it, with
    its own Store (engine) and id lease."""

    def __init__(self, settings: Settings) -> None:
        self.store = Store(settings)
        self.ids = ReservedIds(StoreReserver(self.store.engine), f"test:{uuid.uuid4().hex[:8]}",
                             settings.id_reservation_s * 1000, self.store.now_ms)
        self.materialiser = Materialiser(settings, self.store, self.ids)

    def run(self, now_ms: int) -> int:
        created, _more = self.materialiser.run(now_ms)
        return created

    def passes(self, start_ms: int, stop_ms: int, step_ms: int = STEP) -> int:
        """A pass every ``step_ms`` from ``start_ms`` to ``stop_ms`` inclusive; tasks written."""
        return sum(self.run(t) for t in range(start_ms, stop_ms + 1, step_ms))

    def close(self) -> None:
        self.ids.release()
        self.store.close()

#: an occurrence written and not dispatched: DELAYED, or READY when written due
UNDISPATCHED = (Status.DELAYED, Status.READY)


def _client(settings: Settings) -> Iterator[Client]:
    c = Client(settings)
    with c.store.engine.begin() as conn:  # the pg_url fixture empties ax_task, not ax_job
        conn.execute(delete(jobs))
    yield c
    c.close()


def _schedulers(settings: Settings) -> Iterator[Callable[..., Scheduler]]:
    made: list[Scheduler] = []

    def make(**changes: Any) -> Scheduler:
        made.append(Scheduler(settings.replace(**changes) if changes else settings))
        return made[-1]

    yield make
    for s in made:
        s.close()


@pytest.fixture
def client(settings: Settings) -> Iterator[Client]:
    yield from _client(settings)


@pytest.fixture
def make_scheduler(settings: Settings) -> Iterator[Callable[..., Scheduler]]:
    yield from _schedulers(settings)


@pytest.fixture
def scheduler(client: Client, make_scheduler: Callable[..., Scheduler]) -> Scheduler:
    return make_scheduler()


@pytest.fixture
def pg_settings(pg_url: str, tmp_path: Path) -> Settings:
    """Settings on PostgreSQL alone (the race tests need row locks and concurrent writers)."""
    return from_env({}, database_url=pg_url, auto_migrate=True,
                    broker_url=f"ax+sqlite:///{tmp_path / 'broker.sqlite3'}")


@pytest.fixture
def pg_client(pg_settings: Settings) -> Iterator[Client]:
    yield from _client(pg_settings)




# -- helpers -------------------------------------------------------------------------------------


def job_row(client: Client, name: str) -> Row[Any]:
    with client.store.engine.connect() as conn:
        row = job_store.get_job(conn, name)
    assert row is not None
    return row


def anchor(client: Client, name: str) -> int:
    return int(job_row(client, name).anchor_ms)


def occurrences(client: Client, name: str) -> list[TaskView]:
    """The job's tasks, by occurrence time then id."""
    with client.store.engine.connect() as conn:
        rows = conn.execute(select(tasks).where(tasks.c.job == name)
                            .order_by(tasks.c.scheduled_at, tasks.c.task_id)).all()
    return [TaskView.from_row(dict(r._mapping)) for r in rows]


def all_tasks(client: Client) -> list[TaskView]:
    with client.store.engine.connect() as conn:
        rows = conn.execute(select(tasks).order_by(tasks.c.task_id)).all()
    return [TaskView.from_row(dict(r._mapping)) for r in rows]


def when(view: TaskView) -> int:
    """The occurrence time of a job's task."""
    assert view.scheduled_at is not None
    return view.scheduled_at


def times(views: list[TaskView], origin: int) -> list[int]:
    """Occurrence times relative to ``origin``."""
    return [when(v) - origin for v in views]


def by_time(views: list[TaskView]) -> dict[int, TaskView]:
    return {when(v): v for v in views}


def define(client: Client, now_ms: int, name: str, task_type: str = "tick",
           payload: Any = None, **kw: Any) -> str:
    """``schedule()`` on the store side at an injected ``now_ms``."""
    if "cron" in kw:
        kw["cron_expr"] = kw.pop("cron")
    values = build_job(client.settings, now_ms, name, task_type, payload, **kw)
    return schedule_job(client.store.engine, values, now_ms)


def dispatch(client: Client, task_id: int, now_ms: int, *, run: bool = False) -> None:
    """Claim an occurrence as a scheduler would (→ DISPATCHING), and with ``run`` start it."""
    with client.store.engine.begin() as conn:
        (claimed,) = claims.claim(conn, [task_id], "node-a", now_ms)
        if run:
            assert transitions.transition(conn, [task_id], [Status.DISPATCHING], Status.RUNNING,
                                          attempt=claimed.attempt) == [task_id]


def at(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, UTC)


def occurrence_row(task_id: int, job: str, scheduled_at: int) -> dict[str, Any]:
    return {"task_id": task_id, "task_type": "tick", "trigger_time": scheduled_at,
            "status": "CREATED", "priority": "default", "retry_count": 0, "max_retry": 0,
            "timeout_ms": 1000, "processor_name": "tick", "callback_url": None,
            "payload": "{}", "biz_key": None,
            "fingerprint": job_store.occurrence_fingerprint(job, scheduled_at),
            "trace_id": uuid.uuid4().hex, "attempt": 0, "created_at": scheduled_at,
            "job": job, "scheduled_at": scheduled_at}


def wait_for_a_lock_wait(client: Client, thread: threading.Thread) -> None:
    """Until another backend of this database waits on a lock (PostgreSQL)."""
    query = text("SELECT count(*) FROM pg_stat_activity "
                 "WHERE datname = current_database() AND wait_event_type = 'Lock'")
    for _ in range(1000):
        with client.store.engine.connect() as conn:
            if conn.execute(query).scalar_one():
                return
        thread.join(0.01)
        assert thread.is_alive(), "the second insert did not wait for the first"
    raise AssertionError("the second insert never waited on the unique index")


def behind(client: Client, scheduler: Scheduler, misfire: str, **kw: Any) -> int:
    """An every-second job run on time until A+2000 (occurrences A+1..4 s written, none
    dispatched: every scheduler then stops); returns A."""
    client.schedule("beat", "tick", {"n": 1}, every=1, misfire=misfire, **kw)
    a = anchor(client, "beat")
    assert scheduler.passes(a, a + 2000) == 4
    assert job_row(client, "beat").next_fire_at == a + 5000
    return a


def assert_misfire_cancelled(views: list[TaskView], now: int) -> None:
    for v in views:
        assert v.status is Status.CANCELLED and v.finished_at == now
        assert v.last_error is not None and "misfire" in v.last_error


# -- 1. schedule() is an idempotent upsert -------------------------------------------------------


def test_schedule_twice_with_the_same_arguments_writes_nothing(client: Client,
                                                                scheduler: Scheduler) -> None:
    first = client.schedule("beat", "tick", {"a": 1, "b": [1, 2]}, every=1, priority="high")
    a = anchor(client, "beat")
    assert scheduler.passes(a, a + 1000) == 3
    before_row = job_row(client, "beat")
    written = [(v.task_id, v.scheduled_at, v.trigger_time, v.payload)
               for v in occurrences(client, "beat")]

    again = client.schedule("beat", "tick", {"b": [1, 2], "a": 1}, every=1, priority="high")
    assert define(client, a + 5000, "beat", "tick", {"a": 1, "b": [1, 2]}, every=1,
                  priority="high") == "unchanged"

    assert len(client.jobs()) == 1
    assert again.updated_at == first.updated_at == before_row.updated_at
    assert again.created_at == first.created_at
    assert job_row(client, "beat") == before_row
    assert [(v.task_id, v.scheduled_at, v.trigger_time, v.payload)
            for v in occurrences(client, "beat")] == written


def test_a_new_payload_replaces_the_undispatched_future_occurrences_on_the_same_grid(
        client: Client, scheduler: Scheduler) -> None:
    a = client.store.now_ms()
    assert define(client, a, "beat", "tick", {"v": 1}, every=1) == "created"
    assert scheduler.passes(a, a + 3000) == 5  # A+1 .. A+5 s
    old = by_time(occurrences(client, "beat"))
    dispatch(client, old[a + 1000].task_id, a + 1000)  # sent: the job's no longer

    # changed at A+2500: A+2000 is due (not yet dispatched), A+3000.. are to come
    assert define(client, a + 2500, "beat", "tick", {"v": 2}, every=1) == "updated"
    row = job_row(client, "beat")
    assert row.anchor_ms == a and row.updated_at == a + 2500 and row.next_fire_at == a + 3000
    left = by_time(occurrences(client, "beat"))
    assert sorted(left) == [a + 1000, a + 2000]
    assert left[a + 1000].status is Status.DISPATCHING and left[a + 1000].payload == {"v": 1}
    assert left[a + 2000].task_id == old[a + 2000].task_id and left[a + 2000].payload == {"v": 1}

    assert scheduler.run(a + 3000) == 3  # written again from the new definition: A+3 .. A+5 s
    new = by_time(occurrences(client, "beat"))
    assert sorted(new) == [a + k * 1000 for k in range(1, 6)]  # not re-anchored
    for t in (a + 3000, a + 4000, a + 5000):
        assert new[t].payload == {"v": 2} and new[t].task_id != old[t].task_id
        assert new[t].trigger_time == t and new[t].status in UNDISPATCHED


def test_a_new_interval_restarts_the_schedule_from_now(client: Client,
                                                        scheduler: Scheduler) -> None:
    a = client.store.now_ms()
    define(client, a, "beat", every=1)
    assert scheduler.run(a) == 2  # A+1, A+2 s
    assert define(client, a + 500, "beat", every=3) == "updated"
    row = job_row(client, "beat")
    assert (row.anchor_ms, row.next_fire_at, row.every_ms) == (a + 500, a + 3500, 3000)
    assert occurrences(client, "beat") == []  # the old plan's future occurrences are gone
    scheduler.passes(a + 750, a + 6000)
    assert times(occurrences(client, "beat"), a) == [3500, 6500]


@pytest.mark.parametrize(("before", "after"), [
    ({"cron": "0 * * * *", "tz": "UTC"}, {"cron": "0 * * * *", "tz": "Asia/Kolkata"}),
    ({"cron": "0 * * * *", "tz": "UTC"}, {"cron": "30 * * * *", "tz": "UTC"}),
    ({"every": 3600}, {"cron": "30 * * * *", "tz": "UTC"}),
])
def test_a_new_cron_or_zone_is_planned_from_now(client: Client, scheduler: Scheduler,
                                                before: dict[str, Any],
                                                after: dict[str, Any]) -> None:
    hour = 3_600_000
    base = client.store.now_ms() // hour * hour  # a whole UTC hour: Kolkata is +05:30
    a = base + 10 * 60_000
    define(client, a, "hourly", **before)
    first = job_row(client, "hourly").next_fire_at
    assert first == (base + hour if "cron" in before else a + hour)
    scheduler.run(first - 1000)
    assert times(occurrences(client, "hourly"), 0) == [first]

    now = first - 500  # the occurrence is written and half a second away
    assert define(client, now, "hourly", **after) == "updated"
    row = job_row(client, "hourly")
    assert row.anchor_ms == now and row.next_fire_at == base + hour + 30 * 60_000
    assert occurrences(client, "hourly") == []
    scheduler.run(row.next_fire_at - 1000)
    assert times(occurrences(client, "hourly"), 0) == [base + hour + 30 * 60_000]


def test_a_paused_job_stays_paused_when_scheduled_again(client: Client,
                                                        scheduler: Scheduler) -> None:
    client.schedule("beat", "tick", {"v": 1}, every=1)
    a = anchor(client, "beat")
    assert client.pause("beat").paused
    for every, payload in ((1, {"v": 1}), (1, {"v": 2}), (2, {"v": 2})):
        view = client.schedule("beat", "tick", payload, every=every)
        assert view.paused and view.next_fire_at is None
        assert scheduler.passes(a, a + 3000) == 0
    assert occurrences(client, "beat") == []
    client.resume("beat")
    b = anchor(client, "beat")  # re-anchored by the change to every=2
    scheduler.run(b)
    assert [(when(v) - b, v.payload) for v in occurrences(client, "beat")] == [
        (2000, {"v": 2})]


# -- 2. the materialiser, pass by pass -----------------------------------------------------------


def test_passes_write_one_task_per_occurrence(client: Client, scheduler: Scheduler) -> None:
    client.schedule("beat", "metrics.flush", {"shard": 3}, every=1, priority="high",
                    max_retry=2, timeout_ms=4000)
    a = anchor(client, "beat")
    written = 0
    for now in range(a, a + 20_000 + 1, STEP):
        written += scheduler.run(now)
        # written ahead by the lookahead, never more, never a gap
        assert times(occurrences(client, "beat"), a) == list(range(1000, now - a + 2001, 1000))
    views = occurrences(client, "beat")
    assert written == len(views) == 22
    assert len({v.fingerprint for v in views}) == 22
    for v in views:
        assert v.scheduled_at is not None
        assert v.job == "beat" and v.trigger_time == v.scheduled_at
        assert v.status in UNDISPATCHED and v.attempt == 0
        assert (v.task_type, v.payload, v.priority, v.max_retry, v.timeout_ms) == (
            "metrics.flush", {"shard": 3}, "high", 2, 4000)
        assert v.fingerprint == job_store.occurrence_fingerprint("beat", v.scheduled_at)
    assert job_row(client, "beat").next_fire_at == a + 23_000

    got = client.get(views[4].task_id)
    assert (got.job, got.scheduled_at, got.trigger_time) == ("beat", a + 5000, a + 5000)
    one_off = client.get(client.enqueue("metrics.flush", {"shard": 3}, delay=60))
    assert (one_off.job, one_off.scheduled_at) == (None, None)


def test_a_pass_with_nothing_due_writes_nothing(client: Client, scheduler: Scheduler) -> None:
    client.schedule("slow", "tick", every=60)
    a = anchor(client, "slow")
    assert scheduler.passes(a, a + 57_000, 1000) == 0  # 60 s away is beyond the lookahead
    assert scheduler.run(a + 58_000) == 1
    assert times(occurrences(client, "slow"), a) == [60_000]


# -- 3. exactly one task per occurrence ----------------------------------------------------------


def test_the_same_occurrence_inserted_twice_is_one_row(client: Client) -> None:
    ids = client.ids.next_ids(4)
    with client.store.engine.begin() as conn:
        assert job_store.insert_occurrences(conn, [occurrence_row(ids[0], "j", 5000)]) == [ids[0]]
    with client.store.engine.begin() as conn:  # a second scheduler, a retried commit
        assert job_store.insert_occurrences(conn, [occurrence_row(ids[1], "j", 5000)]) == []
        assert job_store.insert_occurrences(conn, [occurrence_row(ids[2], "j", 6000),
                                                   occurrence_row(ids[3], "j", 6000)]) == [ids[2]]
    assert [(v.task_id, v.scheduled_at) for v in all_tasks(client)] == [(ids[0], 5000),
                                                                        (ids[2], 6000)]


@pytest.mark.integration
def test_concurrent_inserts_of_one_occurrence_write_one_row(pg_client: Client) -> None:
    client = pg_client
    other = Store(client.settings)
    ids = client.ids.next_ids(2)
    result: list[list[int]] = []
    try:
        with client.store.engine.begin() as conn:
            assert job_store.insert_occurrences(conn, [occurrence_row(ids[0], "j", 5000)])

            def second() -> None:  # waits on the first's uncommitted row, then skips
                with other.engine.begin() as c2:
                    result.append(job_store.insert_occurrences(
                        c2, [occurrence_row(ids[1], "j", 5000)]))

            thread = threading.Thread(target=second)
            thread.start()
            wait_for_a_lock_wait(client, thread)  # the unique index holds it back
            assert result == []
        thread.join(10)
        assert result == [[]]
    finally:
        other.close()
    assert [v.task_id for v in all_tasks(client)] == [ids[0]]


def test_two_schedulers_racing_write_each_occurrence_once(
        client: Client, make_scheduler: Callable[..., Scheduler]) -> None:
    """Two stores (engines) from two threads, one pass each at the same simulated time:
    on PostgreSQL the job rows' FOR UPDATE, on SQLite BEGIN IMMEDIATE, then the unique index."""
    names = [f"job{i:02d}" for i in range(8)]
    for name in names:
        client.schedule(name, "tick", {"name": name}, every=1)
    a = max(anchor(client, n) for n in names)
    pair = [make_scheduler(), make_scheduler()]
    barrier = threading.Barrier(2, timeout=30)
    written = [0, 0]
    errors: list[Exception] = []

    def run(i: int) -> None:
        try:
            for now in range(a, a + 20_000 + 1, STEP):
                barrier.wait()  # both run the same pass at once
                written[i] += pair[i].run(now)
        except Exception as exc:  # noqa: BLE001 - asserted below; the barrier frees the other
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    views = all_tasks(client)
    assert sum(written) == len(views)
    for name in names:
        mine = occurrences(client, name)
        first = anchor(client, name)
        assert len({v.scheduled_at for v in mine}) == len(mine)
        assert times(mine, first) == list(range(1000, a - first + 22_001, 1000)), name


# -- 4. misfires after an outage -----------------------------------------------------------------


def test_fire_once_runs_the_latest_missed_occurrence_once(client: Client,
                                                          scheduler: Scheduler) -> None:
    a = behind(client, scheduler, "fire_once")
    now = a + 10_000  # every scheduler was down from A+2 s
    assert scheduler.run(now) == 1 + 4  # the catch-up, then A+9 .. A+12 s on time
    views = occurrences(client, "beat")
    assert times(views, a) == [1000, 2000, 3000, 4000, 8000, 9000, 10_000, 11_000, 12_000]
    assert_misfire_cancelled(views[:4], now)
    catch_up = [v for v in views if v.trigger_time == now != v.scheduled_at]
    assert [(v.scheduled_at, v.status) for v in catch_up] == [(a + 8000, Status.READY)]
    assert all(v.trigger_time == v.scheduled_at and v.status in UNDISPATCHED
               for v in views[5:])
    assert job_row(client, "beat").next_fire_at == a + 13_000
    assert scheduler.run(now + STEP) == 0  # settled: the next pass is on time again


def test_skip_runs_nothing_that_was_missed(client: Client, scheduler: Scheduler) -> None:
    a = behind(client, scheduler, "skip")
    now = a + 10_000
    assert scheduler.run(now) == 4
    views = occurrences(client, "beat")
    assert times(views, a) == [1000, 2000, 3000, 4000, 9000, 10_000, 11_000, 12_000]
    assert_misfire_cancelled(views[:4], now)
    assert all(v.trigger_time == v.scheduled_at for v in views[4:])


def test_fire_all_runs_the_latest_missed_oldest_first_up_to_misfire_max(
        client: Client, make_scheduler: Callable[..., Scheduler]) -> None:
    scheduler = make_scheduler(misfire_max=3)
    a = behind(client, scheduler, "fire_all")
    now = a + 10_000  # missed: A+1 .. A+8 s (four of them written, none sent)
    assert scheduler.run(now) == 3 + 4
    views = occurrences(client, "beat")
    assert times(views, a) == [1000, 2000, 3000, 4000, 6000, 7000, 8000,
                               9000, 10_000, 11_000, 12_000]
    assert_misfire_cancelled(views[:4], now)
    catch_up = views[4:7]
    # catch-ups trigger at the pass, 1 ms apart: dispatched oldest first
    assert [v.trigger_time for v in catch_up] == [now, now + 1, now + 2]
    assert all(v.status in UNDISPATCHED for v in catch_up)
    assert all(v.trigger_time == v.scheduled_at for v in views[7:])


def test_fire_all_under_the_cap_keeps_the_written_ones_and_adds_the_rest(
        client: Client, scheduler: Scheduler) -> None:
    a = behind(client, scheduler, "fire_all")
    now = a + 10_000
    written = {v.task_id for v in occurrences(client, "beat")}
    assert scheduler.run(now) == 4 + 4
    views = occurrences(client, "beat")
    assert times(views, a) == list(range(1000, 12_001, 1000))
    assert all(v.status in UNDISPATCHED for v in views)
    assert {v.task_id for v in views[:4]} == written  # kept: run as catch-ups
    # all eight catch-ups trigger at the pass, oldest first, the written ones included
    assert [v.trigger_time for v in views[:8]] == [now + i for i in range(8)]
    assert all(v.trigger_time == v.scheduled_at for v in views[8:])


def test_misfire_grace_drops_the_older_missed_occurrences(
        client: Client, make_scheduler: Callable[..., Scheduler]) -> None:
    scheduler = make_scheduler()
    a = behind(client, scheduler, "fire_all", misfire_grace_s=3.5)
    now = a + 10_000  # only A+7 s and A+8 s are within 3.5 s
    assert scheduler.run(now) == 2 + 4
    views = occurrences(client, "beat")
    assert times(views, a) == [1000, 2000, 3000, 4000, 7000, 8000, 9000, 10_000, 11_000,
                               12_000]
    assert_misfire_cancelled(views[:4], now)
    assert [v.trigger_time for v in views[4:6]] == [now, now + 1]


def test_fire_once_with_everything_older_than_the_grace_runs_nothing(
        client: Client, scheduler: Scheduler) -> None:
    a = behind(client, scheduler, "fire_once", misfire_grace_s=0.5)
    now = a + 10_000
    assert scheduler.run(now) == 4
    views = occurrences(client, "beat")
    assert times(views, a) == [1000, 2000, 3000, 4000, 9000, 10_000, 11_000, 12_000]
    assert_misfire_cancelled(views[:4], now)


def test_an_occurrence_up_to_on_time_ms_late_is_late_not_missed(
        client: Client, scheduler: Scheduler) -> None:
    client.schedule("beat", "tick", every=1, misfire="skip")
    a = anchor(client, "beat")
    now = a + 1000 + ON_TIME_MS  # the first pass, a whole ON_TIME_MS after A+1 s
    assert scheduler.run(now) == 4
    views = occurrences(client, "beat")
    assert times(views, a) == [1000, 2000, 3000, 4000]
    assert all(v.trigger_time == v.scheduled_at for v in views)


@pytest.mark.parametrize("misfire", ["skip", "fire_once"])
def test_an_occurrence_written_before_the_outage_of_a_slow_job_is_misfired(
        client: Client, scheduler: Scheduler, misfire: str) -> None:
    client.schedule("slow", "tick", every=5, misfire=misfire)
    a = anchor(client, "slow")
    assert scheduler.passes(a, a + 3000) == 1  # A+5 s written; next_fire_at A+10 s
    now = a + 60_000  # every scheduler down from A+3 s to A+60 s
    scheduler.run(now)
    views = occurrences(client, "slow")
    assert views[0].scheduled_at == a + 5000
    runs = [when(v) - a for v in views
            if v.status is not Status.CANCELLED and when(v) < now - ON_TIME_MS]
    assert runs == ([55_000] if misfire == "fire_once" else [])
    assert_misfire_cancelled(views[:1], now)


# -- 5. pause, resume, unschedule ----------------------------------------------------------------


@pytest.mark.parametrize(("misfire", "missed_runs"), [
    ("fire_once", [6000]), ("skip", []), ("fire_all", [2000, 3000, 4000, 5000, 6000])])
def test_pause_removes_the_undispatched_and_resume_applies_the_misfire_policy(
        client: Client, scheduler: Scheduler, misfire: str, missed_runs: list[int]) -> None:
    client.schedule("beat", "tick", every=1, misfire=misfire)
    a = anchor(client, "beat")
    assert scheduler.passes(a, a + 1000) == 3  # A+1 .. A+3 s
    sent = occurrences(client, "beat")[0]
    dispatch(client, sent.task_id, a + 1000)

    view = client.pause("beat")
    assert view.paused and view.next_fire_at is None
    assert client.pause("beat").updated_at == view.updated_at  # pausing twice: a no-op
    assert [(v.task_id, v.status) for v in occurrences(client, "beat")] == [
        (sent.task_id, Status.DISPATCHING)]
    assert scheduler.passes(a + 1250, a + 6000) == 0  # nothing while paused
    assert len(occurrences(client, "beat")) == 1

    assert not client.resume("beat").paused
    now = a + 8000  # A+2 .. A+6 s were missed while paused
    scheduler.run(now)
    views = occurrences(client, "beat")
    assert views[0].task_id == sent.task_id and views[0].status is Status.DISPATCHING
    caught_up = [when(v) - a for v in views
                 if now <= v.trigger_time < now + 100 and v.trigger_time != v.scheduled_at]
    assert caught_up == missed_runs
    on_time = [when(v) - a for v in views[1:] if v.trigger_time == v.scheduled_at]
    assert on_time == [7000, 8000, 9000, 10_000]


def test_a_pause_and_an_immediate_resume_lose_no_occurrence(client: Client,
                                                            scheduler: Scheduler) -> None:
    client.schedule("beat", "tick", every=1)
    a = anchor(client, "beat")
    scheduler.run(a)
    removed = {v.task_id for v in occurrences(client, "beat")}
    client.pause("beat")
    client.resume("beat")
    assert scheduler.run(a + STEP) == 2  # written again, as new tasks
    views = occurrences(client, "beat")
    assert times(views, a) == [1000, 2000] and not removed & {v.task_id for v in views}
    assert all(v.trigger_time == v.scheduled_at for v in views)


def test_unschedule_removes_the_job_and_its_undispatched_occurrences(
        client: Client, scheduler: Scheduler) -> None:
    client.schedule("beat", "tick", every=1)
    client.schedule("other", "tick", every=1)
    a = max(anchor(client, "beat"), anchor(client, "other"))
    scheduler.passes(a, a + 2000)
    views = occurrences(client, "beat")
    assert len(views) >= 4
    dispatch(client, views[0].task_id, a + 5000)
    dispatch(client, views[1].task_id, a + 5000, run=True)
    others = occurrences(client, "other")

    assert client.unschedule("beat") == len(views) - 2
    assert [j.name for j in client.jobs()] == ["other"]
    with pytest.raises(JobNotFound):
        client.job("beat")
    assert [(v.task_id, v.status) for v in occurrences(client, "beat")] == [
        (views[0].task_id, Status.DISPATCHING), (views[1].task_id, Status.RUNNING)]
    assert occurrences(client, "other") == others
    assert scheduler.passes(a + 2250, a + 3000) == 1  # "other" goes on, "beat" is gone
    assert len(occurrences(client, "beat")) == 2


def test_an_unknown_job_raises_job_not_found(client: Client) -> None:
    for call in (client.unschedule, client.pause, client.resume, client.job,
                 client.next_fires):
        with pytest.raises(JobNotFound, match="nope"):
            call("nope")


# -- 6. dedup does not touch occurrences ---------------------------------------------------------


def test_one_offs_and_occurrences_are_not_deduplicated_against_each_other(
        client: Client, scheduler: Scheduler) -> None:
    client.schedule("beat", "push", {"to": "all"}, every=1)
    a = anchor(client, "beat")
    scheduler.passes(a, a + 3000)  # A+1 .. A+5 s written
    near_occurrence = client.enqueue("push", {"to": "all"}, run_at=at(a + 5000))
    assert near_occurrence.created  # not a duplicate of the occurrence at the same time
    before_one = client.enqueue("push", {"to": "all"}, run_at=at(a + 12_000))
    assert before_one.created

    scheduler.passes(a + 3000 + STEP, a + 20_000)
    views = occurrences(client, "beat")
    assert times(views, a) == list(range(1000, 22_001, 1000))  # none dropped as a duplicate
    assert len({v.fingerprint for v in views}) == len(views)
    ids = {v.task_id for v in views}
    assert near_occurrence not in ids and before_one not in ids
    assert client.get(near_occurrence).job is None
    assert len(all_tasks(client)) == len(views) + 2
    # the dedup still holds among one-offs
    again = client.enqueue("push", {"to": "all"}, run_at=at(a + 6000))
    assert again == near_occurrence and again.duplicate


# -- 7. bad input writes nothing -----------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"cron": "61 * * * *"}, "cron"),
    ({"cron": "* * *"}, "fields"),
    ({"every": 60, "tz": "Mars/Olympus"}, "time zone"),
    ({"cron": "0 * * * *", "tz": "Mars/Olympus"}, "time zone"),
    ({"cron": "0 * * * *", "every": 60}, "exactly one"),
    ({}, "exactly one"),
    ({"every": 0.5}, "every"),
    ({"every": 60, "misfire": "sometimes"}, "misfire"),
    ({"every": 60, "misfire_grace_s": -1}, "misfire_grace_s"),
    ({"every": 60, "priority": "urgent"}, "priority"),
])
def test_bad_input_raises_and_writes_nothing(client: Client, scheduler: Scheduler,
                                             kwargs: dict[str, Any], match: str) -> None:
    client.schedule("keep", "tick", {"v": 1}, every=3600)
    a = anchor(client, "keep")
    scheduler.run(a + 3600_000 - 1000)
    jobs_before, rows_before = client.jobs(), all_tasks(client)
    for name in ("keep", "new"):
        with pytest.raises(ValidationError, match=match):
            client.schedule(name, "tick", {"v": 2}, **kwargs)
    assert client.jobs() == jobs_before
    assert all_tasks(client) == rows_before

