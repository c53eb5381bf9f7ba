"""Malformed and hostile messages on a worker's queue (issue 11), on real Redis and RabbitMQ.

Every kind is published ahead of 1,000 good tasks on the same queue. Each bad
message must be refused once with its reason (``ax_rejected_messages_total``),
never come back, and never hold up the good tasks behind it: all 1,000 reach
SUCCESS.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import Any

import pytest
from kombu import Producer
from prometheus_client import REGISTRY
from sqlalchemy import func, select

from ax_kombu.broker.connection import connection
from ax_kombu.broker.rejects import REASONS
from ax_kombu.config import Settings, from_env
from ax_kombu.core.states import Status
from ax_kombu.store import transitions
from ax_kombu.store.schema import tasks

from .harness import eventually
from .test_worker import Dispatch, running

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

GOOD = 1000
#: a task id no row has
NO_SUCH_TASK = 2**62 + 12345


@pytest.fixture(params=["redis-puller", "redis-kombu-consumer", "amqp"])
def settings(request: pytest.FixtureRequest, pg_url: str) -> Settings:
    """Each way a worker receives: Redis with the puller or Kombu's consumer, RabbitMQ."""
    broker: dict[str, str] = request.getfixturevalue(
        "amqp_broker" if request.param == "amqp" else "redis_broker")
    return from_env({}, database_url=pg_url, heartbeat_interval_s=0.2, worker_grace_s=10,
                    redis_pull=request.param == "redis-puller", **broker)


def task_body(**changes: Any) -> dict[str, Any]:
    """A well-formed message body for a task that does not exist; ``None`` drops a field."""
    body: dict[str, Any] = {
        "v": 1, "task_id": NO_SUCH_TASK, "attempt": 1, "task_type": "t.noop", "payload": {},
        "trace_id": "tr", "trigger_time": 0, "timeout_ms": 1000, "priority": "default",
        "retry_count": 0, "max_retry": 0, "processor": None, "callback_url": None,
        "dispatched_at": 0, "node": "attacker"}
    body.update(changes)
    return {k: v for k, v in body.items() if v is not None or k in ("processor", "callback_url")}


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def as_json(text: str) -> dict[str, Any]:
    return {"body": text.encode(), "content_type": "application/json",
            "content_encoding": "utf-8"}


def json_of(body: Any) -> dict[str, Any]:
    return as_json(json.dumps(body))


#: (the reason it is refused for, what is published: Producer.publish's arguments)
BAD: list[tuple[str, dict[str, Any]]] = [
    ("not_json", as_json('{"v": 1, "task_id": ')),
    ("not_json", {"body": b"\xff\xfe\x00garbage", "content_type": "application/json",
                  "content_encoding": "utf-8"}),
    ("content_type", {"body": task_body(), "serializer": "pickle"}),
    ("content_type", {"body": b"v: 1\ntask_id: 5\n", "content_type": "application/x-yaml",
                      "content_encoding": "utf-8"}),
    ("content_type", {"body": json.dumps(task_body()).encode(), "content_type": "text/plain",
                      "content_encoding": "utf-8"}),
    ("not_task", json_of([1, 2, 3])),
    ("not_task", json_of({"task_id": 5, "attempt": 1})),
    ("missing_field", json_of(task_body(attempt=None))),
    ("missing_field", json_of({"v": 1, "task_id": 5})),
    ("wrong_type", json_of(task_body(attempt="1"))),
    ("wrong_type", json_of(task_body(task_id=True))),
    ("wrong_type", json_of(task_body(timeout_ms=1000.0))),
    ("wrong_type", json_of(task_body(task_type=["t.noop"]))),
    ("wrong_type", json_of(task_body(processor=7))),
    ("bad_value", json_of(task_body(attempt=0))),
    ("bad_value", json_of(task_body(task_id=-1))),
    ("bad_value", json_of(task_body(priority="urgent"))),
    ("bad_value", json_of(task_body(callback_url="http://x/" + "a" * 5000))),
    ("too_large", json_of(task_body(payload="x" * 10_000_000))),  # 10 MB
    ("too_large", json_of(task_body(payload=list(range(200_000))))),  # 200,000 values
    ("too_deep", as_json(json.dumps(task_body())[:-1] + ', "extra": ' + nested(100_000) + "}")),
    ("too_deep", as_json(json.dumps(task_body(payload=None))[:-1]
                         + ', "payload": ' + nested(500) + "}")),
    ("too_deep", as_json(json.dumps(task_body(payload=None))[:-1]
                         + ', "payload": ' + nested(70) + "}")),
    ("unknown_task", json_of(task_body())),
]


def rejected(reason: str) -> float:
    return REGISTRY.get_sample_value("ax_rejected_messages_total", {"reason": reason}) or 0.0


def publish_bad(settings: Settings, redis: bool) -> Counter[str]:
    """Publish every bad kind to the default queue; returns how many of each reason."""
    expected: Counter[str] = Counter()
    queue = settings.queue_default
    with connection(settings) as conn:
        producer = Producer(conn.default_channel)
        for reason, publish in BAD:
            producer.publish(exchange="", routing_key=queue, **publish)
            expected[reason] += 1
        if redis:  # values no Kombu producer would write, straight onto the list
            channel = conn.default_channel
            with channel.conn_or_acquire() as client:
                key = channel._q_for_pri(queue, 0)
                envelope = {"body": "{not json", "content-encoding": "utf-8",
                            "content-type": "application/json", "headers": {},
                            "properties": {"delivery_mode": 2, "priority": 0,
                                           "delivery_info": {"exchange": "",
                                                             "routing_key": queue},
                                           "delivery_tag": "x.1"}}
                for value in (b"\xff not json", b"[1, 2]", b'{"body": 5}', nested(100_000),
                              json.dumps(envelope)):
                    client.lpush(key, value)
                expected["not_kombu"] += 4  # not JSON, not an object, no body, nested
                expected["not_json"] += 1
    return expected


def ready_tasks(dispatch: Dispatch, n: int, batch: str) -> list[int]:
    ids = [int(t) for t in dispatch.client.enqueue_many(
        [{"task_type": "t.noop", "payload": {"batch": batch, "i": i}} for i in range(n)])]
    with dispatch.client.store.engine.begin() as conn:
        transitions.transition(conn, ids, [Status.CREATED], Status.READY)
    return ids


def test_malformed_messages_are_refused_once_and_good_tasks_flow_behind_them(
        settings: Settings, dispatch: Dispatch) -> None:
    redis = settings.broker_url.startswith("redis")
    before = {reason: rejected(reason) for reason in REASONS}
    baseline, ids = ready_tasks(dispatch, GOOD, "alone"), ready_tasks(dispatch, GOOD, "behind")
    with running(settings) as worker:
        started = time.monotonic()  # the normal rate: 1,000 good tasks alone
        dispatch.dispatch(baseline)
        eventually(lambda: worker.stats["succeeded"] == GOOD, timeout=60.0,
                   what=f"{GOOD} baseline tasks done")
        normal = time.monotonic() - started

        expected = publish_bad(settings, redis)
        messages = dispatch.claim(ids)
        assert len(messages) == GOOD
        started = time.monotonic()
        dispatch.publish(messages)  # behind every bad message, on the same queue
        eventually(lambda: worker.stats["succeeded"] == 2 * GOOD, timeout=60.0,
                   what=f"{GOOD} good tasks done behind the bad ones")
        behind = time.monotonic() - started

        def counts() -> dict[str, float]:
            return {r: rejected(r) - before[r] for r in REASONS if rejected(r) - before[r]}

        eventually(lambda: counts() == dict(expected), timeout=20.0,
                   what=f"rejections counted as {dict(expected)}, got {counts()}")
        time.sleep(1.0)  # anything requeued would be received and counted again by now
        assert counts() == dict(expected)
        assert worker.stats["malformed"] == sum(expected.values()) - 1  # all but unknown_task
        assert worker.stats["refused_missing"] == 1
        assert dispatch.queue_depth("default") == 0
    with dispatch.client.store.engine.connect() as conn:
        statuses = dict(conn.execute(select(tasks.c.status, func.count())
                                     .group_by(tasks.c.status)).all())
    assert statuses == {str(Status.SUCCESS): 2 * GOOD}
    print(f"\n{GOOD} good tasks: {normal:.2f}s alone, {behind:.2f}s behind "
          f"{sum(expected.values())} bad messages")
    assert behind < 3 * normal + 2.0  # the 10 MB body and the rest cost little
