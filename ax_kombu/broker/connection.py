"""Connections and queues: how ax reaches the broker through Kombu.

Queues: one per priority — ``high``, ``default``, ``slow`` (names configurable)
— declared durable and bound to the default exchange, so a publish is a
single "put on queue" (no exchange lookup round trip).
"""

from __future__ import annotations

from typing import Any

from kombu import Connection, Queue

from ax_kombu.broker.transports import register as register_transports
from ax_kombu.config import PRIORITIES, Settings


def connection(settings: Settings) -> Connection:
    """A (lazy) Kombu connection to the configured broker."""
    register_transports()
    options: dict[str, Any] = {}
    if settings.broker_url.startswith(("redis", "rediss")):
        options["global_keyprefix"] = settings.broker_key_prefix
        options["socket_timeout"] = 10
        options["ack_emulation"] = settings.redis_ack_emulation
    return Connection(settings.broker_url, transport_options=options, connect_timeout=5)


def task_queues(settings: Settings) -> dict[str, Queue]:
    """The kombu Queue for each priority."""
    return {p: Queue(settings.queue_for(p), routing_key=settings.queue_for(p), durable=True)
            for p in PRIORITIES}


def declare_queues(conn: Connection, settings: Settings) -> None:
    channel = conn.default_channel
    for queue in task_queues(settings).values():
        queue(channel).declare()
