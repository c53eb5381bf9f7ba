"""The hand-off: a Celery-bound task's publish recorded as its end (DISPATCHING → SUCCESS).

A task for stock Celery workers (runner ``'celery'``, :mod:`ax_kombu.core.runners`) is run
by a Celery worker that never reports to ax. ax's part ends when the broker has certainly
accepted its message: from then on Celery's own delivery and acknowledgement semantics
apply (at-least-once with ``acks_late``, at-most-once without). So the scheduler that
published it records the *hand-off* as the task's end, SUCCESS, with the Celery task id
and queue as its ``result``: ``ax inspect`` shows which Celery task to look for. A task for
workers running the AxBootstep (``'celery_ax'``) is not handed off: the bootstep records
its run (:mod:`ax_kombu.celery.bootstep`).

:class:`CeleryHandOff` is one of the scheduler's ``on_published`` hooks
(:class:`ax_kombu.scheduler.node.Scheduler`, ``publish_hooks``; ``ax-scheduler`` installs
it). Contracts:

* **Fenced by attempt** like every move: a row cancelled, or claimed again, meanwhile does
  not move; a gated task's end wakes what waits on its order key or limit, in the same
  transaction.
* **Never raises into the dispatcher**: a database error is logged, and the rows are left
  DISPATCHING to the ack timeout, which sends them again
  (:func:`ax_kombu.store.recovery.redispatch_unacked`): a scheduler that died or failed
  between the publish and this write leaves a task Celery may receive twice, never one
  that is lost.

Needs no Celery: the scheduler's process imports it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import NamedTuple

from sqlalchemy import Connection
from sqlalchemy.exc import SQLAlchemyError

from ax_kombu.broker.celery_wire import CeleryBound, celery_queue, celery_task_id
from ax_kombu.broker.messages import ClaimedTask
from ax_kombu.store import Store, gates
from ax_kombu.store.transitions import execute_batch, storable

log = logging.getLogger(__name__)

_HAND_OFF = """
    UPDATE ax_task AS t SET status = 'SUCCESS', finished_at = :now, result = v.res
      FROM {source}
     WHERE t.task_id = v.id AND t.attempt = v.att AND COALESCE(t.status, '') = 'DISPATCHING'
 RETURNING task_id, task_type, gated, order_key"""


class Handed(NamedTuple):
    """One attempt of a Celery-bound task whose message the broker accepted."""

    task_id: int
    attempt: int
    #: the ``result`` stored: JSON text (the Celery task id and queue)
    result: str


def handed(messages: Sequence[ClaimedTask]) -> list[Handed]:
    """The hand-off of each message in ``messages`` built for stock Celery workers (its
    stored runner made it a :class:`~ax_kombu.broker.celery_wire.CeleryBound` that the
    bootstep does not fence)."""
    return [Handed(m.task_id, m.attempt, json.dumps(
        {"celery_task_id": celery_task_id(m.task_id, m.attempt),
         "celery_queue": celery_queue(m.processor or "")}))
        for m in messages if isinstance(m, CeleryBound) and not m.fenced]


def record(conn: Connection, hand_offs: Sequence[Handed], now_ms: int) -> list[int]:
    """DISPATCHING → SUCCESS for each hand-off whose row is still at its attempt, in one
    statement; ``finished_at = now_ms``. A gated task's end wakes what waits on its order
    key or limit (:func:`ax_kombu.store.gates.wake_next`), in the same transaction. The
    ends are not announced on ``ax_ended``: this is the scheduler's publish path, and
    PostgreSQL serializes the commits of notifying transactions (producers' wake-ups among
    them); a waiter on a handed-off task finds it at its next re-read (each second).

    Returns:
        The ids that moved.
    """
    if not hand_offs:
        return []
    rows = list(execute_batch(conn, ("id", "att", "res"), _HAND_OFF,
                              [(h.task_id, h.attempt, storable(h.result)) for h in hand_offs],
                              now=now_ms))
    gates.wake_next(conn, [(r.task_type, r.order_key) for r in rows if r.gated])
    return [r.task_id for r in rows]


class CeleryHandOff:
    """``on_published(messages, at_ms)`` hook: Celery-bound tasks whose message reached the
    broker → SUCCESS (see the module docstring).

    Args:
        store: the scheduler's store.
    """

    def __init__(self, store: Store) -> None:
        self.store = store

    def __call__(self, messages: list[ClaimedTask], at_ms: int) -> None:
        hand_offs = handed(messages)
        if hand_offs:
            self.record(hand_offs, at_ms)

    def record(self, hand_offs: list[Handed], at_ms: int) -> int:
        """Write the hand-offs; returns how many rows moved (0 after a database error)."""
        try:
            with self.store.engine.begin() as conn:
                return len(record(conn, hand_offs, at_ms))
        except SQLAlchemyError:
            log.exception("could not record Celery hand-offs; the ack timeout re-sends them",
                          extra={"count": len(hand_offs)})
            return 0
