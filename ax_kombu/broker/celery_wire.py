"""Celery's wire format: a due Celery-bound task as a standard Celery protocol-2 message.

A task row is *Celery-bound* when its ``processor_name`` is ``celery:<queue>``
(:func:`processor_for`); its ``task_type`` is the Celery task name and its payload
``{"args": [...], "kwargs": {...}}`` with, optionally, ``"expires"`` (ISO 8601) and
``"timelimit"`` (``[hard, soft]`` seconds). :mod:`ax_kombu.celery` writes such rows;
the scheduler's publisher sends them with :func:`celery_message` instead of ax's own
format, so an unmodified ``celery worker`` consuming ``<queue>`` runs them.

The message is what Celery's own ``app.send_task`` builds
(``celery.app.amqp.AMQP.as_task_v2``): the headers, a JSON body
``[args, kwargs, embed]``, ``correlation_id`` = the task id, JSON content type.
It is built here by hand, without importing Celery (an optional dependency), and
published to the default exchange with the queue's name as routing key, which
every transport delivers straight to that queue.

* The Celery task id is :func:`celery_task_id` of ``(ax task id, attempt)``: stable
  (the same attempt always has the same id) and new for each attempt. ax publishes
  each attempt exactly once; a worker that runs it runs it under that id.
* Never early. The scheduler hands batches to the publisher up to ``claim_lead_ms``
  before they are due (staging, for ax's own workers). A Celery-bound message handed
  over early is held by the publisher until its trigger time (:func:`split_held`,
  :func:`due_groups`), because a Celery worker is slow with a burst of ``eta``
  messages: 1,000 due at once on Redis started p50 ≈ 850 ms late with ``eta``, ≈ 85 ms
  without (tests/e2e/test_celery_e2e.py). Should a message still leave before its
  trigger time (the hold is capped at :data:`MAX_HOLD_MS`), its ``eta`` header is the
  trigger time, and the Celery worker holds it until then; one published at or after
  its trigger time has no ``eta`` and runs at once.
* ``ax_task_id``, ``ax_attempt`` and ``trace_id`` ride along as extra headers (a Celery
  task sees them as ``self.request.ax_task_id`` …).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime
from typing import Any, NamedTuple

import orjson

from ax_kombu.broker.messages import TaskMessage

#: ``processor_name`` of a Celery-bound task: this prefix, then the Celery queue's name
CELERY_PREFIX = "celery:"
#: the same for a task whose Celery workers run :class:`ax_kombu.celery.AxBootstep`: its
#: run is fenced and recorded by the worker, so the scheduler records no hand-off
FENCED_PREFIX = "celery+ax:"
#: the namespace of :func:`celery_task_id` (a fixed, random UUID: never change it)
TASK_ID_NAMESPACE = uuid.UUID("5f0c2b8e-3a51-4c1e-9a57-1d2f6c3b7e90")
#: the longest a publisher holds Celery-bound messages for their trigger time (the most
#: ``claim_lead_ms`` may be)
MAX_HOLD_MS = 1000
#: as Celery's ``argsrepr_maxsize`` / ``kwargsrepr_maxsize`` defaults
_REPR_MAX = 1024
_EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}


def processor_for(queue: str, fenced: bool = False) -> str:
    """The ``processor_name`` that marks a task as Celery-bound, for ``queue``; ``fenced``:
    its workers run the bootstep."""
    return (FENCED_PREFIX if fenced else CELERY_PREFIX) + queue


def is_celery(processor: str | None) -> bool:
    """True when ``processor`` (a row's ``processor_name``) marks a Celery-bound task."""
    return processor is not None and processor.startswith((CELERY_PREFIX, FENCED_PREFIX))


def is_fenced(processor: str | None) -> bool:
    """True when ``processor`` marks a Celery-bound task run under the bootstep."""
    return processor is not None and processor.startswith(FENCED_PREFIX)


def celery_queue(processor: str) -> str:
    """The Celery queue named in a Celery-bound ``processor``."""
    return processor.partition(":")[2]


def celery_task_id(task_id: int, attempt: int) -> str:
    """The Celery task id of one attempt of an ax task: a UUID, the same on every call."""
    return str(uuid.uuid5(TASK_ID_NAMESPACE, f"{task_id:d}.{attempt:d}"))


def iso_utc(epoch_ms: int) -> str:
    """``epoch_ms`` as ISO 8601 in UTC with an offset, as Celery writes ``eta``."""
    return datetime.fromtimestamp(epoch_ms / 1000, UTC).isoformat()


class CeleryMessage(NamedTuple):
    """One protocol-2 message, ready for ``Producer.publish`` or a Redis envelope."""

    queue: str
    body: str
    headers: dict[str, Any]
    properties: dict[str, Any]


def split_held(messages: Sequence[TaskMessage]) -> tuple[list[TaskMessage], list[TaskMessage]]:
    """``(to publish now, to hold)``: Celery-bound messages built before their trigger
    time are held (see the module docstring); every other message goes now."""
    now: list[TaskMessage] = []
    held: list[TaskMessage] = []
    for m in messages:
        (held if m.trigger_time > m.dispatched_at and is_celery(m.processor) else now).append(m)
    return now, held


def due_groups(held: Sequence[TaskMessage], *, sleep: Callable[[float], None] = time.sleep,
               monotonic: Callable[[], float] = time.monotonic) -> Iterator[list[TaskMessage]]:
    """``held`` in groups, each yielded once it is due, its ``dispatched_at`` = that time.

    "Now" is the messages' ``dispatched_at`` (the dispatcher's clock when it built them,
    just before handing them over) plus the monotonic time since this call; the wait
    for the whole is at most :data:`MAX_HOLD_MS`.
    """
    pending = sorted(held, key=lambda m: m.trigger_time)
    start, base = monotonic(), min(m.dispatched_at for m in pending) if pending else 0
    while pending:
        elapsed = int((monotonic() - start) * 1000)
        now = base + elapsed
        due = [m for m in pending if m.trigger_time <= now]
        if due or elapsed >= MAX_HOLD_MS:
            group = due or pending
            yield [m._replace(dispatched_at=now) for m in group]
            pending = pending[len(group):]
            continue
        sleep(min(pending[0].trigger_time - now, MAX_HOLD_MS - elapsed) / 1000)


def celery_message(m: TaskMessage) -> CeleryMessage:
    """The Celery protocol-2 message for one attempt of a Celery-bound task, published at
    ``m.dispatched_at`` (``eta`` if that is before its trigger time)."""
    payload = orjson.loads(str(m.payload)) if isinstance(m.payload, str) else m.payload
    args = payload.get("args") or []
    kwargs = payload.get("kwargs") or {}
    task_id = celery_task_id(m.task_id, m.attempt)
    timelimit = payload.get("timelimit") or [None, None]
    early = m.dispatched_at < m.trigger_time
    headers = {
        "lang": "py", "task": m.task_type, "id": task_id, "shadow": None,
        "eta": iso_utc(m.trigger_time) if early else None,
        "expires": payload.get("expires"), "group": None, "group_index": None,
        "retries": 0, "timelimit": timelimit, "root_id": task_id, "parent_id": None,
        "argsrepr": repr(tuple(args))[:_REPR_MAX], "kwargsrepr": repr(kwargs)[:_REPR_MAX],
        "origin": f"ax@{m.node}",
        "ignore_result": bool(payload.get("ignore_result")), "replaced_task_nesting": 0,
        "stamped_headers": None, "stamps": {},
        "ax_task_id": m.task_id, "ax_attempt": m.attempt, "trace_id": m.trace_id,
    }
    body = orjson.dumps([args, kwargs, _EMBED]).decode()
    return CeleryMessage(celery_queue(m.processor or ""), body, headers,
                         {"correlation_id": task_id, "reply_to": ""})


def celery_redis_envelope(c: CeleryMessage) -> str:
    """The message as Kombu's Redis transport stores it, published to the default
    exchange with routing key ``c.queue`` at priority 0 (what ``Producer.publish``
    puts; see :func:`ax_kombu.broker.messages.redis_envelope`)."""
    properties = {**c.properties, "delivery_mode": 2, "priority": 0,
                  "delivery_info": {"exchange": "", "routing_key": c.queue},
                  "delivery_tag": c.properties["correlation_id"]}
    return orjson.dumps({"body": c.body, "content-encoding": "utf-8",
                         "content-type": "application/json", "headers": c.headers,
                         "properties": properties}).decode()
