"""Recording the hand-off of Celery-bound tasks after their publish (scheduler side).

:class:`CeleryHandOff` is an ``on_published(messages, at_ms)`` hook of the dispatcher
(:class:`ax_kombu.scheduler.dispatcher.Dispatcher`): of the messages the broker
certainly accepted, the Celery-bound ones (:mod:`ax_kombu.broker.celery_wire`) are
moved DISPATCHING → SUCCESS, fenced by attempt, in one transaction
(:mod:`ax_kombu.store.handoff`). Without it they would stay DISPATCHING, and the ack
timeout would send them to Celery again.

It never raises into the dispatcher: a database error is logged, and the rows are
then left to the ack timeout (Celery may get such a task twice; none is lost).
Messages of ordinary ax tasks are passed through untouched, as is the call to the
next hook.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from sqlalchemy.exc import SQLAlchemyError

from ax_kombu.broker.celery_wire import celery_queue, celery_task_id, is_celery, is_fenced
from ax_kombu.broker.messages import TaskMessage
from ax_kombu.store import Store
from ax_kombu.store.handoff import HandOff, hand_off_many

log = logging.getLogger(__name__)

OnPublished = Callable[[list[TaskMessage], int], None]


def hand_offs(messages: list[TaskMessage]) -> list[HandOff]:
    """The hand-off of each Celery-bound message in ``messages`` whose run is not fenced by
    :class:`ax_kombu.celery.AxBootstep` (that one is recorded by the Celery worker)."""
    return [HandOff(m.task_id, m.attempt, json.dumps(
        {"celery_task_id": celery_task_id(m.task_id, m.attempt),
         "celery_queue": celery_queue(m.processor or "")}))
        for m in messages if is_celery(m.processor) and not is_fenced(m.processor)]


class CeleryHandOff:
    """``on_published`` hook: Celery-bound tasks whose message reached the broker → SUCCESS.

    Args:
        store: the scheduler's store.
        then: the next ``on_published`` hook, called afterwards with every message.
    """

    def __init__(self, store: Store, then: OnPublished | None = None) -> None:
        self.store = store
        self.then = then

    def __call__(self, messages: list[TaskMessage], at_ms: int) -> None:
        handed = hand_offs(messages)
        if handed:
            self.record(handed, at_ms)
        if self.then is not None:
            self.then(messages, at_ms)

    def record(self, handed: list[HandOff], at_ms: int) -> int:
        """Write the hand-offs; returns how many rows moved (0 after a database error)."""
        try:
            with self.store.engine.begin() as conn:
                return len(hand_off_many(conn, handed, at_ms))
        except SQLAlchemyError:
            log.exception("could not record Celery hand-offs; the ack timeout re-sends them",
                          extra={"count": len(handed)})
            return 0
