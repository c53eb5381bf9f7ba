"""A queue without consumer, on PostgreSQL + Redis: a scheduler and a worker in threads.

The worker consumes ``high`` and ``default`` only; ``slow`` tasks fall due with nobody on
their queue for :data:`WINDOW_S`, which is :data:`ACK_TIMEOUTS` ack timeouts. ax must not
take that backlog for a loss: the recovery scan re-dispatches only what a live consumer's
queue has drained (:func:`ax_kombu.store.recovery.redispatch_unacked`), so the broker keeps
at most :data:`MAX_MESSAGES_PER_TASK` messages per waiting task however many ack timeouts
pass. Meanwhile the consumed queues go on. Then a worker comes for ``slow``: each task runs
exactly once (a message of an attempt the row no longer has is refused), never early.

What the window's length buys is the number of ack timeouts, not seconds: with the ack
timeout at :data:`ACK_TIMEOUT_MS` and the recovery scan every 200 ms, a 5 s window is as
many chances to re-publish as 60 s at the 3 s ack timeout of the fault suite, where this
scenario ran before.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from sqlalchemy import bindparam, text

from ax_kombu.api import Client
from ax_kombu.config import Settings, from_env

from .. import procs_worker
from ..waiting import wait_until
from .harness import scheduler_running
from .test_worker import running

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

ACK_TIMEOUT_MS = 250
#: ack timeouts the slow queue goes without a consumer
ACK_TIMEOUTS = 20
WINDOW_S = ACK_TIMEOUT_MS * ACK_TIMEOUTS / 1000
SLOW_TASKS = 50
#: tasks on the consumed queues while the slow queue waits
BUSY_TASKS = 100
#: most messages the broker may keep per task of a queue without consumer
MAX_MESSAGES_PER_TASK = 2
#: how early a start may look because two clocks (worker, database) were read (ms)
CLOCK_TOLERANCE_MS = 5


@pytest.fixture
def settings(pg_url: str, redis_broker: dict[str, str]) -> Settings:
    return from_env({}, database_url=pg_url, ack_timeout_ms=ACK_TIMEOUT_MS,
                    recovery_interval_s=0.2, heartbeat_interval_s=0.2, heartbeat_misses=3,
                    worker_grace_s=10, **redis_broker)


@pytest.fixture
def client(settings: Settings) -> Iterator[Client]:
    c = Client(settings)
    yield c
    c.close()


def queued(settings: Settings, queue: str) -> int:
    """Messages waiting in Redis list ``queue`` (under the settings' key prefix)."""
    r = redis.Redis.from_url(settings.broker_url)
    try:
        return int(r.llen(settings.broker_key_prefix + queue))
    finally:
        r.close()


def rows(client: Client, ids: list[int]) -> dict[int, Any]:
    """Status, attempt and trigger time of the tasks ``ids``, in one read."""
    with client.store.engine.connect() as conn:
        return {r.task_id: r for r in conn.execute(text(
            "SELECT task_id, status, attempt, trigger_time FROM ax_task "
            "WHERE task_id IN :ids").bindparams(bindparam("ids", expanding=True)),
            {"ids": ids})}


def all_succeeded(client: Client, ids: list[int]) -> bool:
    found = rows(client, ids)
    return len(found) == len(ids) and all(r.status == "SUCCESS" for r in found.values())


def test_a_queue_without_consumer_keeps_its_messages_and_each_task_runs_once(
        settings: Settings, client: Client) -> None:
    with running(settings, queues=("high", "default"), node_id="w-busy"), \
            scheduler_running(settings, "s-0"):
        slow = [int(client.enqueue("t.noop", {"i": i}, delay=0.3 + i / 200, priority="slow"))
                for i in range(SLOW_TASKS)]
        busy = [int(client.enqueue("t.noop", {"i": 1000 + i}, delay=0.3 + i / 50,
                                   priority=("high", "default")[i % 2]))
                for i in range(BUSY_TASKS)]
        samples: list[int] = []
        until = time.monotonic() + 0.3 + WINDOW_S
        while time.monotonic() < until:  # sampling the broker for the whole window
            samples.append(queued(settings, settings.queue_slow))
            time.sleep(0.05)
        waiting = rows(client, slow)
        assert wait_until(lambda: all_succeeded(client, busy), 30, 0.1), (
            "the consumed queues did not go on while slow had no consumer")
        with running(settings, queues=("slow",), node_id="w-slow"):
            assert wait_until(lambda: all_succeeded(client, slow), 30, 0.1), (
                f"slow tasks after the consumer came: {rows(client, slow)}")
    most = max(samples)
    print(f"\nslow queue without consumer {WINDOW_S:g} s ({ACK_TIMEOUTS} ack timeouts): "
          f"most messages {most} for {SLOW_TASKS} tasks, at the end {samples[-1]}; attempts "
          f"when the consumer came max {max(v.attempt for v in waiting.values())}")
    assert len(waiting) == SLOW_TASKS and not [v for v in waiting.values()
                                               if v.status == "SUCCESS"]
    assert most <= MAX_MESSAGES_PER_TASK * SLOW_TASKS, (
        f"the broker kept {most} messages for {SLOW_TASKS} tasks")
    assert {i: procs_worker.calls.get(i) for i in slow + busy} == dict.fromkeys(slow + busy, 1)
    early = {i: v.trigger_time - procs_worker.started_ms[i]
             for i, v in rows(client, slow + busy).items()
             if procs_worker.started_ms[i] < v.trigger_time - CLOCK_TOLERANCE_MS}
    assert not early, f"started early (ms): {early}"
