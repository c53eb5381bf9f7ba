"""The scheduler against PostgreSQL + Redis and PostgreSQL + RabbitMQ, read by a plain
Kombu consumer."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from ax_kombu.api import Client
from ax_kombu.config import Settings, from_env
from ax_kombu.core.states import Status

from ..waiting import eventually
from .harness import collecting, scheduler_running

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture
def cfg(pg_url: str, broker: dict[str, str]) -> Settings:
    return from_env({}, database_url=pg_url, heartbeat_interval_s=0.5,
                    preload_interval_ms=60_000, **broker)


@pytest.fixture
def client(cfg: Settings) -> Iterator[Client]:
    c = Client(cfg)
    yield c
    c.close()


def test_tasks_arrive_in_their_priority_queue_once_with_attempt_one(cfg: Settings,
                                                                     client: Client) -> None:
    items = [{"task_type": "t", "payload": {"i": i}, "delay": 0.3 + (i % 10) / 10,
              "priority": ("high", "default", "slow")[i % 3]} for i in range(300)]
    ids = client.enqueue_many(items)
    with collecting(cfg) as got, scheduler_running(cfg):
        assert got.wait_for(lambda: len(got.got) >= 300)
    assert sorted(got.ids()) == sorted(int(i) for i in ids)
    for received in got.got:
        body = received.body
        assert received.queue == cfg.queue_for(body["priority"])
        assert body["attempt"] == 1
        # staged: never more than the claim lead and window early (5 ms clock tolerance)
        assert received.at_ms >= body["trigger_time"] - cfg.claim_reach_ms - 5
    statuses = Counter(client.get(i).status for i in ids[:30])
    assert statuses == {Status.DISPATCHING: 30}


def test_a_short_delay_fires_through_the_wake_up_not_the_next_preload(cfg: Settings,
                                                                       client: Client) -> None:
    with collecting(cfg) as got, scheduler_running(cfg) as scheduler:
        assert got.wait_for(lambda: scheduler.dispatcher.broker_ok.is_set())
        got.wait_for(lambda: False, timeout=0.3)  # let the first preload pass
        task_id = client.enqueue("push", {"n": 1}, delay=0.05)
        # the periodic preload is 60 s away: only the wake-up can make this arrive
        assert got.wait_for(lambda: len(got.got) == 1, timeout=20)
    trigger = client.get(task_id).trigger_time
    assert got.got[0].body["task_id"] == task_id
    assert got.got[0].at_ms >= trigger - cfg.claim_reach_ms - 5  # staged, never more


def test_cancelled_task_is_never_published(cfg: Settings, client: Client) -> None:
    lead_s = cfg.claim_lead_ms / 1000  # due later than the claim lead: still loaded in memory
    keep = client.enqueue("t", {"keep": True}, delay=lead_s + 1.5)
    drop = client.enqueue("t", {"keep": False}, delay=lead_s + 1.0)
    with collecting(cfg) as got, scheduler_running(cfg):
        assert got.wait_for(lambda: client.get(drop).status is Status.DELAYED)  # loaded in memory
        client.cancel(drop)
        assert got.wait_for(lambda: keep in got.ids())
    assert got.ids() == [keep]
    assert client.get(drop).status is Status.CANCELLED


def test_past_due_tasks_go_out_at_once_oldest_first(cfg: Settings, client: Client) -> None:
    from datetime import UTC, datetime, timedelta

    now = datetime.now(UTC)
    ids = [client.enqueue("t", {"i": i}, run_at=now - timedelta(minutes=10 - i))
           for i in range(10)]
    with collecting(cfg) as got, scheduler_running(cfg):
        assert got.wait_for(lambda: len(got.got) == 10)
    assert got.ids() == [int(i) for i in ids]


def test_database_down_at_start_is_waited_for_not_a_crash(broker: dict[str, str],
                                                           caplog: pytest.LogCaptureFixture
                                                           ) -> None:
    from ax_kombu.scheduler.node import Scheduler

    cfg = from_env({}, database_url="postgresql://postgres@127.0.0.1:1/nowhere", **broker)
    scheduler = Scheduler(cfg)
    thread = threading.Thread(target=scheduler.run, daemon=True)
    thread.start()
    eventually(lambda: "database unreachable" in caplog.text, 20, "a retry logged")
    assert thread.is_alive()  # still waiting, not crashed
    scheduler.request_stop()
    thread.join(20)
    assert not thread.is_alive()


def test_running_tasks_of_a_worker_that_is_not_alive_are_recovered(cfg: Settings,
                                                                   client: Client) -> None:
    from ax_kombu.store import claims, nodes, recovery, transitions

    retry, last = client.enqueue("t", {"a": 1}, max_retry=2), client.enqueue("t", {"b": 1},
                                                                              max_retry=0)
    alive = client.enqueue("t", {"c": 1})
    with client.store.engine.begin() as conn:
        transitions.transition(conn, [retry, last, alive], [Status.CREATED], Status.READY)
        rows = claims.claim(conn, [retry, last, alive], "s", client.store.now_ms())
        assert len(rows) == 3
    live = nodes.Heartbeat(client.store, "worker-live", "worker")
    live.register({})
    gone = nodes.Heartbeat(client.store, "worker-gone", "worker")
    gone.register({})
    gone.stop()  # stopped without recording its results (say the database was down)
    with client.store.engine.begin() as conn:
        started = transitions.start_many(conn, [(retry, 1), (last, 1)], "worker-gone",
                                         client.store.now_ms())
        assert sorted(r.task_id for r in started) == sorted([retry, last])
        transitions.start_many(conn, [(alive, 1)], "worker-live", client.store.now_ms())
        now = client.store.now_ms()
        recovered = dict(recovery.recover_orphan_running(conn, now, now - 10_000))
    assert recovered == {retry: "DELAYED", last: "FAILED"}
    assert client.get(retry).retry_count == 1 and client.get(retry).owner_node is None
    assert client.get(last).last_error == "worker lost"
    assert client.get(alive).status is Status.RUNNING  # alive: never rescued by age


def test_a_preload_that_fails_loses_nothing(
        cfg: Settings, client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first preload reads every task, then its connection breaks before the caller
    gets the rows (as when the reply is lost). A read changed nothing, and the node's
    record of what it has read did not move: the next round reads them again."""
    from sqlalchemy.exc import OperationalError

    from ax_kombu.store import preload

    real_preload = preload.preload
    lost: list[int] = []

    def preload_reply_lost(conn: Any, *args: Any) -> Any:
        rows, loaded = real_preload(conn, *args)
        if not lost and rows:
            lost.extend(task_id for task_id, _ in rows)
            raise OperationalError("SELECT", {}, Exception("server closed the connection"))
        return rows, loaded

    monkeypatch.setattr(preload, "preload", preload_reply_lost)
    ids = [int(i) for i in client.enqueue_many(
        [{"task_type": "t", "payload": {"i": i}, "delay": 1.5} for i in range(20)])]
    with collecting(cfg) as got, scheduler_running(cfg):
        assert got.wait_for(lambda: len(got.got) >= 20, timeout=30), \
            f"only {len(got.got)} of 20 dispatched"
    assert sorted(lost) == sorted(ids)  # the first preload did read every one
    assert sorted(got.ids()) == sorted(ids)


