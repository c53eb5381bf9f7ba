"""The Redis puller (ax_kombu.broker.redis_pull) against a real Redis: room, blocking, bad values."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from ax_kombu.broker import redis_pull as intake
from ax_kombu.broker.connection import connection, declare_queues
from ax_kombu.broker.messages import TaskMessage, redis_envelope
from ax_kombu.broker.publisher import Publisher
from ax_kombu.config import Settings, from_env
from tests.wire import version_1_json

from .harness import eventually


def message(i: int, priority: str = "default") -> TaskMessage:
    return TaskMessage(task_id=1000 + i, attempt=1, task_type="t", payload={"i": i},
                       trace_id=f"tr{i}", trigger_time=0, timeout_ms=1000, priority=priority,
                       retry_count=0, max_retry=0, processor=None, callback_url=None,
                       dispatched_at=0, node="scheduler@test")


@pytest.fixture
def settings(redis_broker: dict[str, str]) -> Settings:
    return from_env({}, database_url="sqlite://", **redis_broker)


@pytest.fixture
def conn(settings: Settings) -> Iterator[Any]:
    with connection(settings) as c:
        c.ensure_connection(max_retries=1)
        declare_queues(c, settings)
        yield c


@pytest.fixture
def publish(settings: Settings) -> Iterator[Callable[[list[TaskMessage]], None]]:
    publisher = Publisher(settings)

    def publish(messages: list[TaskMessage]) -> None:
        assert publisher.publish(messages) == []

    yield publish
    publisher.close()


@pytest.fixture
def puller(conn: Any, settings: Settings) -> Iterator[intake.Puller]:
    queues = [settings.queue_high, settings.queue_default]
    p = intake.Puller(conn.channel(), queues, {"application/json"}, lambda: None)
    p.start()
    yield p
    p.stop()


def drained(p: intake.Puller) -> list[intake.Pulled]:
    out = []
    while p.inbox:
        out.append(p.inbox.popleft())
    return out


def test_redis_here_supports_batched_pops(conn: Any) -> None:
    assert intake.supported(conn)


def test_never_pops_more_than_the_room_and_pops_again_when_room_is_released(
        puller: intake.Puller, publish: Callable[[list[TaskMessage]], None],
        settings: Settings) -> None:
    publish([message(i) for i in range(10)])
    puller.set_limit(1, 3)
    eventually(lambda: len(puller.inbox) == 3, timeout=10.0, what="three messages popped")
    with connection(settings) as c:
        assert c.default_channel._size(settings.queue_default) == 7
    first = drained(puller)
    assert [p.body["task_id"] for p in first] == [1000, 1001, 1002]  # oldest first
    assert all(p.lane == 1 and p.error is None for p in first)
    puller.release(1, 2)
    eventually(lambda: len(puller.inbox) == 2, timeout=10.0, what="two more after two acks")
    assert [p.body["task_id"] for p in drained(puller)] == [1003, 1004]
    with connection(settings) as c:
        assert c.default_channel._size(settings.queue_default) == 5  # the rest stay in Redis


def test_a_blocked_pull_wakes_at_once_when_another_lane_gains_room(
        puller: intake.Puller, publish: Callable[[list[TaskMessage]], None],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(intake, "BLOCK_S", 30.0)  # without the wake list this test would fail
    puller.set_limit(0, 1)  # only the (empty) high queue has room: the puller blocks in BRPOP
    publish([message(1), message(2)])  # default has no room yet
    eventually(lambda: puller._blocking, timeout=10.0, what="puller blocked")
    puller.set_limit(1, 2)
    eventually(lambda: len(puller.inbox) == 2, timeout=5.0, what="woken and popped")
    assert [p.body["task_id"] for p in drained(puller)] == [1001, 1002]


def test_a_blocked_pull_returns_a_new_message_at_once(
        puller: intake.Puller, publish: Callable[[list[TaskMessage]], None],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(intake, "BLOCK_S", 30.0)
    puller.set_limit(0, 5)
    eventually(lambda: puller._blocking, timeout=10.0, what="puller blocked")
    publish([message(7, "high")])
    eventually(lambda: len(puller.inbox) == 1, timeout=5.0, what="the message")
    assert drained(puller)[0].body["task_id"] == 1007


def test_values_that_are_not_messages_are_reported_not_raised(
        puller: intake.Puller, conn: Any, settings: Settings) -> None:
    channel = conn.default_channel
    with channel.conn_or_acquire() as client:
        client.lpush(channel._q_for_pri(settings.queue_default, 0), b"\xff not json")
    puller.set_limit(1, 5)
    eventually(lambda: len(puller.inbox) == 1, timeout=10.0, what="the bad value")
    bad = drained(puller)[0]
    assert bad.message is None and bad.error is not None and puller.is_alive()


def test_a_rejected_message_is_requeued_and_popped_next(
        puller: intake.Puller, publish: Callable[[list[TaskMessage]], None],
        settings: Settings) -> None:
    publish([message(i) for i in range(3)])
    puller.set_limit(1, 1)
    eventually(lambda: len(puller.inbox) == 1, timeout=10.0, what="one message popped")
    first = drained(puller)[0]
    assert first.body["task_id"] == 1000 and first.message.content_type == "application/json"
    first.message.reject(requeue=True)
    first.message.reject(requeue=True)  # once settled, a second reject does nothing
    with connection(settings) as c:
        assert c.default_channel._size(settings.queue_default) == 3
    puller.release(1)
    eventually(lambda: len(puller.inbox) == 1, timeout=10.0, what="popped again")
    assert drained(puller)[0].body == first.body  # back where it is popped first


def test_an_acked_message_stays_gone(
        puller: intake.Puller, publish: Callable[[list[TaskMessage]], None],
        settings: Settings) -> None:
    publish([message(1)])
    puller.set_limit(1, 1)
    eventually(lambda: len(puller.inbox) == 1, timeout=10.0, what="the message")
    pulled = drained(puller)[0]
    pulled.message.ack()
    pulled.message.reject(requeue=True)  # after the ack: nothing to put back
    with connection(settings) as c:
        assert c.default_channel._size(settings.queue_default) == 0


def test_payloads_decode_exactly_as_json_does(
        puller: intake.Puller, publish: Callable[[list[TaskMessage]], None], conn: Any,
        settings: Settings) -> None:
    """What ax publishes (version 2) carries no payload; a version-1 message from an older
    scheduler does, and the envelope and body may go through orjson, but that payload (user
    data) must not change type."""
    payload = {"big": 2 ** 70, "neg": -(2 ** 65), "f": 0.1, "s": "é\u2028", "n": None}
    publish([message(1)._replace(payload=payload)])
    full = message(2)._replace(payload=payload)
    envelope = json.loads(redis_envelope(full, settings.queue_default))
    envelope["body"] = version_1_json(full)
    channel = conn.default_channel
    with channel.conn_or_acquire() as client:
        client.lpush(channel._q_for_pri(settings.queue_default, 0), json.dumps(envelope))
    puller.set_limit(1, 2)
    eventually(lambda: len(puller.inbox) == 2, timeout=10.0, what="the messages")
    slim, old = sorted((p.body for p in drained(puller)), key=lambda b: b["task_id"])
    assert "payload" not in slim and TaskMessage.from_body(slim).slim
    assert old["payload"] == payload and isinstance(old["payload"]["big"], int)
