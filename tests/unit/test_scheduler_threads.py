"""The scheduler's threads on the embedded default (SQLite store, ax's SQLite transport):
every task published once, never early; a warm stop leaves what it loaded to the others; the timing
loop's clock reading never waits on the database."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from ax_kombu.api import Client
from ax_kombu.broker.messages import ClaimedTask
from ax_kombu.config import Settings, from_env
from ax_kombu.core.states import Status
from ax_kombu.scheduler.node import Scheduler
from ax_kombu.store.clock import DbClock
from ax_kombu.store.schema import nodes
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def cfg(tmp_path: Path) -> Settings:
    return from_env({}, database_url=f"sqlite:///{tmp_path / 'ax.sqlite3'}",
                    broker_url=f"ax+sqlite:///{tmp_path / 'broker.sqlite3'}",
                    heartbeat_interval_s=0.5, preload_window_ms=120_000)


@pytest.fixture
def client(cfg: Settings) -> Iterator[Client]:
    c = Client(cfg)
    yield c
    c.close()


class Published:
    """What the scheduler's dispatcher reports as published."""

    def __init__(self) -> None:
        self.messages: list[tuple[ClaimedTask, int]] = []
        self._lock = threading.Lock()

    def __call__(self, messages: list[ClaimedTask], at_ms: int) -> None:
        with self._lock:
            self.messages.extend((m, at_ms) for m in messages)


def running(cfg: Settings, published: Published) -> tuple[Scheduler, threading.Thread]:
    scheduler = Scheduler(cfg, "sched-unit", on_published=published)
    thread = threading.Thread(target=scheduler.run, daemon=True)
    thread.start()
    return scheduler, thread


def published_until(cfg: Settings, count: int) -> Published:
    """Run a scheduler node until ``count`` messages are published, then warm-stop it."""
    published = Published()
    scheduler, thread = running(cfg, published)
    try:
        assert wait_until(lambda: len(published.messages) >= count, 30.0)
    finally:
        scheduler.request_stop()
        thread.join(30)
    assert not thread.is_alive()
    return published


def test_each_task_is_published_once_and_never_more_than_the_lead_early(cfg: Settings, client: Client) -> None:
    ids = client.enqueue_many([{"task_type": "t", "payload": {"i": i}, "delay": i / 400}
                               for i in range(200)])
    published = published_until(cfg, 200)
    assert sorted(m.task_id for m, _ in published.messages) == sorted(int(i) for i in ids)
    assert all(m.attempt == 1 for m, _ in published.messages)
    # staged: published at most the lead and the claim window ahead (the worker starts it at
    # its trigger time)
    assert all(at_ms >= m.trigger_time - cfg.claim_reach_ms for m, at_ms in published.messages)


@pytest.mark.parametrize("lead_ms", [0, 300])
def test_tasks_are_claimed_and_published_up_to_the_lead_ahead_never_more(
        cfg: Settings, client: Client, lead_ms: int) -> None:
    cfg = cfg.replace(claim_lead_ms=lead_ms)
    ids = client.enqueue_many([{"task_type": "t", "payload": {"i": i}, "delay": 1 + i / 100}
                               for i in range(40)])
    published = published_until(cfg, 40)
    assert sorted(m.task_id for m, _ in published.messages) == sorted(int(i) for i in ids)
    # staged at most the lead and the claim window ahead (with no lead: never before it is due)
    reach_ms = cfg.claim_reach_ms  # its values: tests/unit/test_config.py
    assert all(at_ms >= m.trigger_time - reach_ms for m, at_ms in published.messages)
    claimed = [client.get(i) for i in ids]
    ahead = [t.trigger_time - t.dispatched_at for t in claimed if t.dispatched_at is not None]
    assert len(ahead) == 40
    if lead_ms:  # claimed before due (but never more than the lead and the window before)
        assert all(0 < a <= reach_ms for a in ahead), ahead
    else:
        assert all(a <= 0 for a in ahead), ahead


def test_the_tasks_a_scheduler_reads_are_not_written_and_a_warm_stop_deregisters(
        cfg: Settings, client: Client) -> None:
    """The preload is a read: tasks in the wheel stay DELAYED, with no owner node, so a
    stop has nothing to hand back; it marks the node stopped, and the others' next preload
    covers its share."""
    ids = client.enqueue_many([{"task_type": "t", "payload": {"i": i}, "delay": 90}
                               for i in range(50)])
    before = {i: client.get(i) for i in ids}
    published = Published()
    scheduler, thread = running(cfg, published)
    try:
        assert wait_until(lambda: len(scheduler.timer) == 50, 30.0)
        assert {(client.get(i).status, client.get(i).owner_node) for i in ids} == {
            (Status.DELAYED, None)}
    finally:
        scheduler.request_stop()
        thread.join(30)
    assert not thread.is_alive()
    assert published.messages == []
    assert {i: client.get(i) for i in ids} == before
    with client.store.engine.connect() as conn:
        (row,) = conn.execute(select(nodes.c.stopped_at).where(nodes.c.node_id == "sched-unit"))
    assert row.stopped_at is not None


def test_the_local_clock_reading_never_asks_the_database() -> None:
    wall = [10_000.0]
    asked = []

    def read_db() -> int:
        asked.append(wall[0])
        return int(wall[0]) + 250

    clock = DbClock(read_db, mono_ms=lambda: wall[0], wall_ms=lambda: wall[0], refresh_s=1e-9)
    assert clock.now_ms() == 10_250 and len(asked) == 3  # measured: three samples
    wall[0] += 40
    assert clock.local_ms() == 10_290.0
    assert len(asked) == 3  # due for a re-measurement, yet local_ms did not do it


def test_a_stage_thread_that_dies_stops_the_node_with_exit_code_70(
        cfg: Settings, client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    from ax_kombu.node.supervision import EXIT_CRASHED
    from ax_kombu.scheduler.claimer import Claimer

    def broken(self: Claimer) -> None:
        raise RuntimeError("claimer broke")

    monkeypatch.setattr(Claimer, "run", broken)
    scheduler = Scheduler(cfg, "sched-crash")
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(scheduler.run()), daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive() and codes == [EXIT_CRASHED]
    assert scheduler.crash.thread == "ax-claimer" and scheduler.stopping == "cold"


STEPS = ["store", "registration", "broker probe", "heart", "dispatcher", "loops ended",
         "claimer", "housekeeper", "retention", "alerts"]


def test_the_node_starts_its_steps_in_the_listed_order_and_stops_them_in_reverse(
        cfg: Settings, caplog: pytest.LogCaptureFixture) -> None:
    """The order is one list: the claimer and the other loops stop (together, then waited
    for) before the dispatcher publishes its last batch, and the heart beats until then."""
    caplog.set_level(logging.DEBUG, logger="ax_kombu.node.steps")
    scheduler = Scheduler(cfg, "sched-steps")
    assert [step.name for step in scheduler.steps()] == STEPS
    thread = threading.Thread(target=scheduler.run, daemon=True)
    thread.start()
    assert wait_until(lambda: scheduler.heart.is_alive() and scheduler.claimer.is_alive(), 30.0)
    scheduler.request_stop()
    thread.join(30)
    assert not thread.is_alive()

    def logged(message: str) -> list[str]:
        return [r.__dict__["step"] for r in caplog.records if r.getMessage() == message]

    assert logged("starting step") == STEPS
    assert logged("stopping step") == STEPS[::-1]
