"""Publishing through Kombu to the priority queues, read back by a plain Kombu consumer."""

from __future__ import annotations

import json
from typing import Any

import pytest

from ax_kombu.broker.connection import task_queues
from ax_kombu.broker.messages import TaskMessage
from ax_kombu.broker.publisher import Publisher
from ax_kombu.config import from_env

from .harness import consume

pytestmark = pytest.mark.timeout(120)


def message(i: int, priority: str) -> TaskMessage:
    return TaskMessage(task_id=i, attempt=1 + i % 2, task_type="t", payload={"i": i, "ü": [1]},
                       trace_id=f"tr{i}", trigger_time=1000 + i, timeout_ms=500,
                       priority=priority, retry_count=0, max_retry=3, processor="t",
                       callback_url=None, dispatched_at=2000, node="n1")


def drain(settings: Any, expected: int, timeout: float = 20.0) -> list[tuple[str, dict[str, Any],
                                                                             dict[str, Any]]]:
    """Everything on the three queues, read by a plain Kombu consumer until ``expected`` came."""
    got = consume(settings, list(task_queues(settings).values()), expected, timeout)
    return [(m.delivery_info["routing_key"], m.payload, m.headers) for m in got]


def test_batches_arrive_in_their_priority_queue(broker: dict[str, str]) -> None:
    settings = from_env({}, **broker)
    publisher = Publisher(settings)
    messages = [message(i, ("high", "default", "slow")[i % 3]) for i in range(1500)]
    assert publisher.publish(messages[:1000]) == []
    assert publisher.publish(messages[1000:]) == []
    publisher.close()
    got = drain(settings, 1500)
    assert len(got) == 1500
    by_id = {body["task_id"]: (queue, body, headers) for queue, body, headers in got}
    assert len(by_id) == 1500
    for m in messages:
        queue, body, headers = by_id[m.task_id]
        assert queue == settings.queue_for(m.priority)
        assert body == json.loads(m.to_json())  # version 2: no payload on the broker
        assert "payload" not in body and TaskMessage.from_body(body).slim
        assert headers["trace_id"] == m.trace_id


def test_unreachable_broker_reports_every_message_unpublished() -> None:
    settings = from_env({}, broker_url="redis://127.0.0.1:1/0")
    messages = [message(i, "high") for i in range(5)]
    assert Publisher(settings).publish(messages) == messages


def test_malformed_bodies_are_refused() -> None:
    with pytest.raises(ValueError):
        TaskMessage.from_body({"v": 1, "task_id": 5})
    with pytest.raises(ValueError):
        TaskMessage.from_body(["not", "a", "message"])


@pytest.mark.integration
@pytest.mark.parametrize("persistent", [False, True])
def test_rabbitmq_messages_are_transient_unless_asked(amqp_broker: dict[str, str],
                                                      persistent: bool) -> None:
    """ax's messages on RabbitMQ: delivery mode 1 by default (the database keeps the task;
    the ack timeout sends again what a restarted broker lost), 2 with
    AX_RABBITMQ_PERSISTENT."""
    settings = from_env({"AX_RABBITMQ_PERSISTENT": "1" if persistent else "0"}, **amqp_broker)
    assert settings.rabbitmq_persistent is persistent
    publisher = Publisher(settings)
    assert publisher.publish([message(i, "default") for i in range(3)]) == []
    publisher.close()
    got = consume(settings, list(task_queues(settings).values()), 3)
    assert [m.properties["delivery_mode"] for m in got] == [2 if persistent else 1] * 3
