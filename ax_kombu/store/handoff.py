"""The end of a Celery-bound task in ax: DISPATCHING → SUCCESS once Celery has it.

A Celery-bound task (:mod:`ax_kombu.broker.celery_wire`) is run by a Celery worker,
which never reports to ax. ax's part ends when the broker has certainly accepted
its message: from then on Celery's own delivery and acknowledgement semantics
apply (at-least-once with ``acks_late``, at-most-once without). So the scheduler
that published it records the *hand-off* as the task's end, SUCCESS, with the
Celery task id as its ``result``: ``ax inspect`` shows which Celery task to look for.

Fenced by attempt like every worker move: a row that was cancelled, or claimed
again, meanwhile does not move. Until the hand-off is recorded, the row is
DISPATCHING, and the ack timeout sends it again (:func:`ax_kombu.store.recovery.
redispatch_unacked`): a scheduler that died between the publish and this write
leaves a task Celery may receive twice; never one that is lost.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from sqlalchemy import Connection

from ax_kombu.store import gates
from ax_kombu.store.transitions import _execute_batch, _storable

_HAND_OFF = """
    UPDATE ax_task AS t SET status = 'SUCCESS', finished_at = :now, result = v.res
      FROM {source}
     WHERE t.task_id = v.id AND t.attempt = v.att AND COALESCE(t.status, '') = 'DISPATCHING'
 RETURNING task_id, task_type, gated, order_key"""


class HandOff(NamedTuple):
    """One attempt of a Celery-bound task whose message the broker accepted."""

    task_id: int
    attempt: int
    #: the ``result`` stored: JSON text (the Celery task id and queue)
    result: str


def hand_off_many(conn: Connection, handed: Sequence[HandOff], now_ms: int) -> list[int]:
    """DISPATCHING → SUCCESS for each hand-off whose row is still at its attempt, in one
    statement; ``finished_at = now_ms``. A gated task's end wakes what waits on its order
    key or limit (:func:`ax_kombu.store.gates.wake_next`), in the same transaction.

    Returns:
        The ids that moved.
    """
    if not handed:
        return []
    rows = list(_execute_batch(conn, ("id", "att", "res"), _HAND_OFF,
                               [(h.task_id, h.attempt, _storable(h.result)) for h in handed], now=now_ms))
    gates.wake_next(conn, [(r[1], r[3]) for r in rows if r[2]])
    return [r[0] for r in rows]
