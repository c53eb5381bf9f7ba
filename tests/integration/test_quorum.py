"""RabbitMQ quorum queues (issue 24, first part): ``AX_RABBITMQ_QUEUE_TYPE=quorum`` declares
ax's queues — per priority and each worker's own — as quorum queues, and the whole path
(publish with confirms, the worker's receive, acks) runs on them. On this machine's single
RabbitMQ node (a quorum queue needs no second node to exist); the cluster scenarios are
issue 24's to come."""

from __future__ import annotations

import pytest
from kombu import Queue

from ax_kombu.broker.connection import connection
from ax_kombu.config import from_env, worker_queue
from ax_kombu.core.states import Status

from .harness import eventually
from .test_worker import Dispatch, running

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_quorum_queues_carry_the_whole_path(pg_url: str, amqp_broker: dict[str, str]) -> None:
    settings = from_env({"AX_RABBITMQ_QUEUE_TYPE": "quorum"}, database_url=pg_url,
                        heartbeat_interval_s=0.2, worker_grace_s=10, **amqp_broker)
    dispatch = Dispatch(settings)
    try:
        ids = [dispatch.enqueue("t.noop", {"i": i}, priority=("high", "default", "slow")[i % 3])
               for i in range(9)]
        with running(settings) as worker:
            dispatch.dispatch(ids)
            eventually(lambda: all(dispatch.status(i) is Status.SUCCESS for i in ids))
            own = worker_queue(worker.node_id)
        assert all(dispatch.view(i).attempt == 1 for i in ids)
    finally:
        dispatch.close()
    # each queue is a quorum queue: RabbitMQ refuses to declare it again as a classic one
    classic = from_env({}, **amqp_broker)
    for name, expires in [(settings.queue_high, None), (settings.queue_default, None),
                          (settings.queue_slow, None), (own, 86_400.0)]:
        with connection(classic) as conn, pytest.raises(conn.channel_errors,
                                                         match="x-queue-type"):
            Queue(name, routing_key=name, durable=True, expires=expires)(
                conn.channel()).declare()
