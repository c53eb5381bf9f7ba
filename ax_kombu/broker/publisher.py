"""Publishing a batch of task messages through Kombu, and knowing which reached the broker.

* Publishing a batch (:class:`Publisher`): on Redis, Kombu's pipelined
  ``Producer.batch()`` (one round trip for many messages); on RabbitMQ, the
  channel is put in publisher-confirm mode and the batch is published and
  then waited on as a whole, so a message counts as published only once the
  broker has confirmed it (after a nack the connection is made anew: see
  :meth:`Publisher._confirmed`); on any other transport, one ``publish`` each.
  :meth:`Publisher.publish` reports which messages did *not* certainly reach
  the broker, so the caller can return their tasks to READY.
* A Celery-bound task (a :class:`~ax_kombu.broker.celery_wire.CeleryBound` message: its
  row's stored runner is a Celery one) goes out as a standard Celery protocol-2 message
  to the Celery queue its ``processor_name`` names, in the same batch and with the
  same confirms (:mod:`ax_kombu.broker.celery_wire`); the first publish to a Celery
  queue on a connection declares it as Celery declares its queues (durable), unless
  it exists already (then it is left as it is).
* Every message is built before anything is sent. One that cannot be built (a
  Celery-bound task whose payload that format cannot carry) is *refused*: it is left
  out, reported with its reason (:attr:`Sent.refused`), and the rest of the batch is
  published. It is never reported as unpublished (it would go back to READY and be
  claimed again for ever).
* On RabbitMQ an ax message is transient unless ``AX_RABBITMQ_PERSISTENT`` says otherwise
  (:attr:`ax_kombu.config.Settings.rabbitmq_persistent`): the database, not the broker,
  keeps the task, and the ack timeout sends again what a restarted broker lost. A
  Celery-bound message is always persistent.
* Nothing waits here: every message is published when handed over. The scheduler
  hands a Celery-bound task over only once it is due (:mod:`ax_kombu.store.claims`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from kombu import Connection, Producer, Queue

from ax_kombu.broker.celery_wire import (
    CeleryBound,
    CeleryMessage,
    celery_message,
    celery_redis_envelope,
)
from ax_kombu.broker.connection import connection, declare_queues, ensure_connected
from ax_kombu.broker.messages import Sendable, headers_of, redis_envelope
from ax_kombu.config import PRIORITIES, Settings, redact_url

log = logging.getLogger(__name__)


class _Confirms:
    """Tracks RabbitMQ publisher confirms on one channel (delivery tags count from 1)."""

    def __init__(self, channel: Any) -> None:
        self.sent = 0
        self.pending: set[int] = set()
        self.nacked: set[int] = set()
        channel.confirm_select()
        channel.events["basic_ack"].add(self._ack)
        channel.events["basic_nack"].add(self._nack)

    def sent_one(self) -> int:
        self.sent += 1
        self.pending.add(self.sent)
        return self.sent

    def _settle(self, tag: int, multiple: bool) -> set[int]:
        settled = {t for t in self.pending if t <= tag} if multiple else {tag} & self.pending
        self.pending -= settled
        return settled

    def _ack(self, tag: int, multiple: bool) -> None:
        self._settle(tag, multiple)

    def _nack(self, tag: int, multiple: bool) -> None:
        self.nacked |= self._settle(tag, multiple)


class Sent(NamedTuple):
    """What became of a batch: the messages that did not certainly reach the broker (their
    tasks go back to READY), and those refused unsent, each with the reason it could not be
    built (their tasks end FAILED)."""

    failed: list[Sendable]
    refused: list[tuple[Sendable, str]]


#: one message ready to send: the ax message, and its Celery form when it is Celery-bound
_Built = tuple[Sendable, CeleryMessage | None]


class Publisher:
    """Publishes batches of task messages to the priority queues; see the module docstring."""

    def __init__(self, settings: Settings, *, confirm_timeout_s: float = 10.0) -> None:
        self.settings = settings
        self.confirm_timeout_s = confirm_timeout_s
        self._queues = {p: settings.queue_for(p) for p in PRIORITIES}
        #: ax's own messages: transient unless asked (Settings.rabbitmq_persistent)
        self._delivery_mode = 2 if settings.rabbitmq_persistent else 1
        self._conn: Connection | None = None
        self._producer: Producer | None = None
        self._confirms: _Confirms | None = None
        #: Redis only: one client kept for the publisher's pipelines
        self._redis: Any = None
        #: Celery queues known to exist on this connection
        self._celery_queues: set[str] = set()

    def connect(self) -> None:
        """Connect (once) and declare the queues.

        Raises:
            OSError and kombu's connection errors when the broker is unreachable.
        """
        if self._producer is not None:
            return
        conn = connection(self.settings)
        try:
            ensure_connected(conn)
            declare_queues(conn, self.settings)
            channel = conn.channel()
            self._confirms = _Confirms(channel) if conn.transport.driver_type == "amqp" else None
            self._producer = Producer(channel, serializer="json", auto_declare=False)
        except BaseException:
            conn.release()
            raise
        self._conn = conn
        log.info("publisher connected", extra={"broker": redact_url(self.settings.broker_url)})

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.release()
            except Exception:
                log.debug("error closing broker connection", exc_info=True)
        self._conn = self._producer = self._confirms = self._redis = None
        self._celery_queues = set()

    def publish(self, messages: Sequence[Sendable]) -> list[Sendable]:
        """Publish ``messages`` at once; returns those that did not certainly reach the
        broker, refused ones (:meth:`send`) included."""
        sent = self.send(messages)
        return sent.failed + [m for m, _ in sent.refused]

    def send(self, messages: Sequence[Sendable]) -> Sent:
        """Build every message, then publish those built at once (see the module docstring).

        Never raises for a broker problem, nor for a message that cannot be built: the
        connection is dropped (and made again on the next call) and the affected messages
        are in :attr:`Sent.failed`; an unbuildable one is in :attr:`Sent.refused`.
        """
        built, refused = _build(messages)
        if not built:
            return Sent([], refused)
        try:
            self.connect()
            if self._confirms is not None:
                return Sent(self._confirmed(built), refused)
            self._publish_plain(built)
            return Sent([], refused)
        except Exception as exc:
            log.debug("publish error", exc_info=True)
            log.warning("publish failed; tasks go back to READY",
                        extra={"count": len(built), "error": repr(exc)})
            self.close()
            return Sent([m for m, _ in built], refused)

    def _send(self, message: Sendable, wire: CeleryMessage | None) -> None:
        assert self._producer is not None
        if wire is not None:
            self._send_celery(wire)
            return
        self._producer.publish(message.to_json(),
                               routing_key=message.route or self._queues[message.priority],
                               exchange="", headers=headers_of(message),
                               delivery_mode=self._delivery_mode,
                               content_type="application/json", content_encoding="utf-8")

    def _send_celery(self, c: CeleryMessage) -> None:
        assert self._producer is not None and self._conn is not None
        self._declare_celery_queue(c.queue)
        self._producer.publish(c.body, routing_key=c.queue, exchange="", headers=c.headers,
                               delivery_mode=2, content_type="application/json",
                               content_encoding="utf-8", **c.properties)

    def _declare_celery_queue(self, name: str) -> None:
        """Make sure the Celery queue ``name`` exists, once per connection: a passive
        declare, then (it does not exist) a durable one as Celery makes it; each on a
        channel of its own, which the broker may close on a failed passive declare."""
        if name in self._celery_queues:
            return
        assert self._conn is not None
        for passive in (True, False):
            channel = self._conn.channel()
            try:
                queue = Queue(name, routing_key=name, durable=True)(channel)
                if passive:
                    queue.queue_declare(passive=True)
                else:
                    queue.declare()
                break
            except self._conn.channel_errors:
                if not passive:
                    raise
            finally:
                try:
                    channel.close()
                except Exception:  # already closed by the broker
                    log.debug("declare channel already closed", exc_info=True)
        self._celery_queues.add(name)

    def _publish_plain(self, built: Sequence[_Built]) -> None:
        assert self._producer is not None
        if self._conn is not None and self._conn.transport.driver_type == "redis":
            self._publish_redis(built)
            return
        with self._producer.batch(max_size=max(len(built), 1)):
            for message, wire in built:
                self._send(message, wire)

    def _publish_redis(self, built: Sequence[_Built]) -> None:
        """One round trip: per queue, one multi-value LPUSH in Kombu's Redis message format.

        Equivalent to ``Producer.publish`` to the default exchange at priority 0
        (Kombu's channel names the list key and applies the key prefix), so any
        Kombu consumer reads these messages, in the order given (LPUSH of
        several values pushes them left in turn; Kombu pops from the right).
        Building the envelope here skips Kombu's per-message
        serialise → base64 → serialise work.
        """
        assert self._producer is not None
        channel: Any = self._producer.channel
        by_queue: dict[str, list[str]] = {}
        for m, wire in built:
            if wire is not None:
                by_queue.setdefault(wire.queue, []).append(celery_redis_envelope(wire))
                continue
            queue = m.route or self._queues[m.priority]
            by_queue.setdefault(queue, []).append(redis_envelope(m, queue))
        if self._redis is None:  # Kombu's conn_or_acquire() would build a client per batch
            self._redis = channel.Client(connection_pool=channel.pool)
        pipe = self._redis.pipeline(transaction=False)
        for queue, values in by_queue.items():
            pipe.lpush(channel._q_for_pri(queue, 0), *values)
        pipe.execute()

    def _confirmed(self, built: Sequence[_Built]) -> list[Sendable]:
        """Publish with confirms; after a nack the connection is dropped (made again on the
        next call), so the next batch goes out on a new channel: on RabbitMQ 3.10 a channel
        that published to a quorum queue while it had no leader (its node just died)
        has every later publish nacked, even once a new leader is elected."""
        failed = self._publish_confirmed(built)
        if failed:
            log.warning("publishes nacked by the broker; tasks go back to READY, the "
                        "channel is replaced", extra={"count": len(failed)})
            self.close()
        return failed

    def _publish_confirmed(self, built: Sequence[_Built]) -> list[Sendable]:
        confirms, conn = self._confirms, self._conn
        assert confirms is not None and conn is not None
        tags = []
        for message, wire in built:
            self._send(message, wire)
            tags.append(confirms.sent_one())
        stop = time.monotonic() + self.confirm_timeout_s
        while confirms.pending:
            left = stop - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{len(confirms.pending)} publishes not confirmed in time")
            conn.drain_events(timeout=left)
        failed = [m for tag, (m, _) in zip(tags, built, strict=True) if tag in confirms.nacked]
        confirms.nacked.clear()
        return failed


def _build(messages: Sequence[Sendable]) -> tuple[list[_Built], list[tuple[Sendable, str]]]:
    """Each message with its Celery form (None for an ax message), and those that could not
    be built, each with the reason."""
    built: list[_Built] = []
    refused: list[tuple[Sendable, str]] = []
    for m in messages:
        if not isinstance(m, CeleryBound):
            built.append((m, None))
            continue
        try:
            built.append((m, celery_message(m)))
        except Exception as exc:  # noqa: BLE001 - any failure to build refuses this one alone
            refused.append((m, f"cannot build the Celery message: {exc}"))
    if refused:
        log.error("messages that cannot be built are refused; their tasks fail",
                  extra={"count": len(refused), "task_ids": [m.task_id for m, _ in refused][:20],
                         "error": refused[0][1]})
    return built, refused
