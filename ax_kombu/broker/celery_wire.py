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
* Never early. The scheduler claims a Celery-bound task only once it is due on its
  database clock, not ``claim_lead_ms`` ahead as it stages ax's own tasks
  (:mod:`ax_kombu.store.claims`), because a stock Celery worker cannot hold a message
  cheaply: 1,000 ``eta`` messages due at once on Redis started p50 ≈ 850 ms late,
  ≈ 85 ms without ``eta`` (tests/e2e/test_celery_e2e.py). So a message never has an
  ``eta``: the Celery worker runs it as soon as it reads it.
* ``ax_task_id``, ``ax_attempt`` and ``trace_id`` ride along as extra headers (a Celery
  task sees them as ``self.request.ax_task_id`` …).
"""

from __future__ import annotations

import uuid
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


class CeleryMessage(NamedTuple):
    """One protocol-2 message, ready for ``Producer.publish`` or a Redis envelope."""

    queue: str
    body: str
    headers: dict[str, Any]
    properties: dict[str, Any]


def celery_message(m: TaskMessage) -> CeleryMessage:
    """The Celery protocol-2 message for one attempt of a Celery-bound task (due: no ``eta``)."""
    payload = orjson.loads(str(m.payload)) if isinstance(m.payload, str) else m.payload
    args = payload.get("args") or []
    kwargs = payload.get("kwargs") or {}
    task_id = celery_task_id(m.task_id, m.attempt)
    timelimit = payload.get("timelimit") or [None, None]
    headers = {
        "lang": "py", "task": m.task_type, "id": task_id, "shadow": None,
        "eta": None,
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
