"""What the worker accepts from the broker: a task message goes to the intake, anything
else is refused once.

Contract: a message is judged before it is decoded (size, content type: JSON
only) and after (an ax task message with every field of the right type and
range, :mod:`ax_kombu.broker.rejects`). A refused message is logged once with
its reason, counted in ``ax_rejected_messages_total{reason}`` and removed from
the broker without requeue, so it can never come back in a loop or stall the
good messages behind it.
"""

from __future__ import annotations

import logging
from typing import Any

from ax_kombu.broker import rejects
from ax_kombu.broker.messages import TaskMessage
from ax_kombu.broker.rejects import Rejected
from ax_kombu.config import Settings
from ax_kombu.observability import metrics
from ax_kombu.worker.counters import Counters
from ax_kombu.worker.lanes import Lane
from ax_kombu.worker.run import Run

log = logging.getLogger(__name__)


class Admission:
    """Judges what arrives on the consuming thread; good task messages go to ``pending``.

    Args:
        pending: the intake's list of received deliveries (appended to).
        stats: the worker's counters (``malformed`` per refusal).
    """

    def __init__(self, settings: Settings, pending: list[Run[Lane]], stats: Counters) -> None:
        self._pending = pending
        self._stats = stats
        #: longest message body decoded
        self.body_limit = rejects.body_limit(settings.max_payload_bytes)

    def on_raw(self, lane: Lane, generation: int, message: Any) -> None:
        """A Kombu consumer's message, undecoded: judged, decoded, then as on_message."""
        try:
            body = rejects.decode_body(message.body, message.content_type,
                                       message.content_encoding, message.headers,
                                       self.body_limit)
        except Rejected as exc:
            self.refuse(lane.queue.name, message, exc)
            return
        self.on_message(lane, generation, body, message)

    def on_message(self, lane: Lane, generation: int, body: Any, message: Any) -> bool:
        """A decoded body: to the intake if it is a task message (True), else refused."""
        try:
            task = TaskMessage.from_body(body)
        except Rejected as exc:
            self.refuse(lane.queue.name, message, exc)
            return False
        lane.unacked += 1
        self._pending.append(Run(lane=lane, task=task, message=message, generation=generation))
        return True

    def on_decode_error(self, message: Any, exc: Exception) -> None:
        """Kombu could not make a message of what arrived (never passed to on_raw)."""
        queue = (getattr(message, "delivery_info", None) or {}).get("routing_key")
        self.refuse(queue, message, Rejected("not_kombu", str(exc)[:200]))

    def refuse(self, queue: str | None, message: Any, exc: Exception) -> None:
        """Log and count a refused message once, and remove it from the broker for good.

        ``reject`` without requeue: RabbitMQ drops it (or dead-letters it, if a
        policy gives the queue a dead-letter exchange); on Redis it is gone
        already. Never requeued, so it cannot come back in a loop.
        """
        reason = exc.reason if isinstance(exc, Rejected) else "not_kombu"
        self._stats.add("malformed")
        metrics.rejected_messages_total.labels(reason=reason).inc()
        log.warning("message rejected, not run", extra={
            "queue": queue, "reason": reason, "error": str(exc)[:300],
            "content_type": getattr(message, "content_type", None)})
        if message is not None:
            message.reject(requeue=False)
