"""Everything ax says to the message broker goes through Kombu, from here.

* Queues: one per priority — ``high``, ``default``, ``slow`` (names
  configurable) — declared durable and bound to the default exchange, so a
  publish is a single "put on queue" (no exchange lookup round trip).
* Messages: JSON only, one per task attempt (see :class:`TaskMessage`), with
  the trace id also in the headers.
* Publishing a batch (:class:`Publisher`): on Redis, Kombu's pipelined
  ``Producer.batch()`` (one round trip for many messages); on RabbitMQ, the
  channel is put in publisher-confirm mode and the batch is published and
  then waited on as a whole, so a message counts as published only once the
  broker has confirmed it; on any other transport, one ``publish`` each.
  :meth:`Publisher.publish` reports which messages did *not* certainly reach
  the broker, so the caller can return their tasks to READY.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from json.encoder import encode_basestring as _encode_string
from typing import Any, NamedTuple

from kombu import Connection, Producer, Queue

from .config import PRIORITIES, Settings, redact_url
from .transport import register as register_transports

log = logging.getLogger(__name__)

MESSAGE_VERSION = 1


class RawJson(str):
    """A payload that is already JSON text (as stored in the task row): sent as is."""


def _js(value: str | None) -> str:
    return "null" if value is None else _encode_string(value)


class TaskMessage(NamedTuple):
    """What a worker receives for one attempt of one task (a NamedTuple: the scheduler
    builds tens of thousands a second, and a tuple is several times cheaper to make)."""

    task_id: int
    attempt: int
    task_type: str
    payload: Any
    trace_id: str
    trigger_time: int
    timeout_ms: int
    priority: str
    retry_count: int
    max_retry: int
    processor: str | None
    callback_url: str | None
    dispatched_at: int
    node: str

    def body(self) -> dict[str, Any]:
        """The body as a dict (what a consumer receives after JSON decoding)."""
        body: dict[str, Any] = json.loads(self.to_json())
        return body

    def to_json(self) -> str:
        """The JSON body, built directly (the payload is spliced in if it is RawJson)."""
        payload = self.payload if isinstance(self.payload, RawJson) else json.dumps(
            self.payload, separators=(",", ":"), ensure_ascii=False)
        return (f'{{"v":{MESSAGE_VERSION},"task_id":{self.task_id:d},"attempt":{self.attempt:d},'
                f'"task_type":{_js(self.task_type)},"payload":{payload},'
                f'"trace_id":{_js(self.trace_id)},"trigger_time":{self.trigger_time:d},'
                f'"timeout_ms":{self.timeout_ms:d},"priority":{_js(self.priority)},'
                f'"retry_count":{self.retry_count:d},"max_retry":{self.max_retry:d},'
                f'"processor":{_js(self.processor)},"callback_url":{_js(self.callback_url)},'
                f'"dispatched_at":{self.dispatched_at:d},"node":{_js(self.node)}}}')

    @classmethod
    def from_body(cls, body: Any) -> TaskMessage:
        """Parse a received body.

        Raises:
            ValueError: the body is not an ax task message.
        """
        if not isinstance(body, dict) or body.get("v") != MESSAGE_VERSION:
            raise ValueError("not an ax task message")
        try:
            return cls._make([body[k] for k in cls._fields])
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed ax task message: {exc}") from None


def redis_envelope(m: TaskMessage, queue: str) -> str:
    """The message as Kombu's Redis transport stores it (what ``Producer.publish`` would put)."""
    return (f'{{"body":{_encode_string(m.to_json())},"content-encoding":"utf-8",'
            f'"content-type":"application/json","headers":{{"trace_id":{_js(m.trace_id)}}},'
            f'"properties":{{"delivery_mode":2,"priority":0,"delivery_info":{{"exchange":"",'
            f'"routing_key":{_js(queue)}}},"delivery_tag":"{m.task_id}.{m.attempt}"}}}}')


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


class Publisher:
    """Publishes batches of task messages to the priority queues; see the module docstring."""

    def __init__(self, settings: Settings, *, confirm_timeout_s: float = 10.0) -> None:
        self.settings = settings
        self.confirm_timeout_s = confirm_timeout_s
        self._queues = {p: settings.queue_for(p) for p in PRIORITIES}
        self._conn: Connection | None = None
        self._producer: Producer | None = None
        self._confirms: _Confirms | None = None
        #: Redis only: one client kept for the publisher's pipelines
        self._redis: Any = None

    def connect(self) -> None:
        """Connect (once) and declare the queues.

        Raises:
            OSError and kombu's connection errors when the broker is unreachable.
        """
        if self._producer is not None:
            return
        conn = connection(self.settings)
        try:
            conn.ensure_connection(max_retries=1)
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

    def publish(self, messages: Sequence[TaskMessage]) -> list[TaskMessage]:
        """Publish ``messages``; returns those that did not certainly reach the broker.

        Never raises for a broker problem: the connection is dropped (and made
        again on the next call) and the affected messages are returned.
        """
        if not messages:
            return []
        try:
            self.connect()
            if self._confirms is not None:
                return self._publish_confirmed(messages)
            self._publish_plain(messages)
            return []
        except Exception as exc:
            log.debug("publish error", exc_info=True)
            log.warning("publish failed; tasks go back to READY",
                        extra={"count": len(messages), "error": repr(exc)})
            self.close()
            return list(messages)

    def _send(self, message: TaskMessage) -> None:
        assert self._producer is not None
        self._producer.publish(message.to_json(), routing_key=self._queues[message.priority],
                               exchange="", headers={"trace_id": message.trace_id},
                               delivery_mode=2, content_type="application/json",
                               content_encoding="utf-8")

    def _publish_plain(self, messages: Sequence[TaskMessage]) -> None:
        assert self._producer is not None
        if self._conn is not None and self._conn.transport.driver_type == "redis":
            self._publish_redis(messages)
            return
        with self._producer.batch(max_size=max(len(messages), 1)):
            for message in messages:
                self._send(message)

    def _publish_redis(self, messages: Sequence[TaskMessage]) -> None:
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
        for m in messages:
            queue = self._queues[m.priority]
            by_queue.setdefault(queue, []).append(redis_envelope(m, queue))
        if self._redis is None:  # Kombu's conn_or_acquire() would build a client per batch
            self._redis = channel.Client(connection_pool=channel.pool)
        pipe = self._redis.pipeline(transaction=False)
        for queue, values in by_queue.items():
            pipe.lpush(channel._q_for_pri(queue, 0), *values)
        pipe.execute()

    def _publish_confirmed(self, messages: Sequence[TaskMessage]) -> list[TaskMessage]:
        confirms, conn = self._confirms, self._conn
        assert confirms is not None and conn is not None
        tags = []
        for message in messages:
            self._send(message)
            tags.append(confirms.sent_one())
        stop = time.monotonic() + self.confirm_timeout_s
        while confirms.pending:
            left = stop - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{len(confirms.pending)} publishes not confirmed in time")
            conn.drain_events(timeout=left)
        failed = [m for tag, m in zip(tags, messages, strict=True) if tag in confirms.nacked]
        confirms.nacked.clear()
        return failed
