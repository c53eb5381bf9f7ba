"""Celery's wire format: a due Celery-bound task as a standard Celery protocol-2 message.

A task row is *Celery-bound* when its stored ``runner`` is ``'celery'`` or ``'celery_ax'``
(:mod:`ax_kombu.core.runners`; never read from a name); only :mod:`ax_kombu.celery` writes
such rows, with ``processor_name`` ``celery:<queue>`` (:func:`processor_for`) naming the
Celery queue. Its ``task_type`` is the Celery task name and its payload
``{"args": [...], "kwargs": {...}}`` with, optionally, ``"expires"`` (ISO 8601),
``"timelimit"`` (``[hard, soft]`` seconds) and ``"ignore_result"``. The dispatcher makes
its claimed row a :class:`CeleryBound` message; the scheduler's publisher sends that with
:func:`celery_message` instead of ax's own format, so an unmodified ``celery worker``
consuming ``<queue>`` runs it.

* A payload this format cannot carry (not such an object, args not a list, …) makes
  :func:`celery_message` raise :class:`Unbuildable` with the reason: the publisher leaves
  that message out of its batch, and its task ends FAILED with the reason
  (:func:`ax_kombu.store.gates.fail_unbuildable`); the rest of the batch is sent.

The message is what Celery's own ``app.send_task`` builds
(``celery.app.amqp.AMQP.as_task_v2``): the headers, a JSON body
``[args, kwargs, embed]``, ``correlation_id`` = the task id, JSON content type.
It is built here by hand, without importing Celery (an optional dependency), and
published to the default exchange with the queue's name as routing key, which
every transport delivers straight to that queue.

* The Celery task id is :func:`celery_task_id` of ``(ax task id, attempt)``: stable
  (the same attempt always has the same id) and new for each attempt. ax publishes
  each attempt exactly once; a worker that runs it runs it under that id.
* Never early, and on time. A task for workers running the bootstep (runner
  ``'celery_ax'``) is staged as ax's own are: claimed and published up to
  :data:`ax_kombu.core.runners.CELERY_AX_LEAD_MS` (1 s) before it is due, with Celery's own
  ``eta`` header = its trigger time,
  so the Celery worker's timer keeps it until the due instant (an ``eta`` message does not
  count against the worker's prefetch), and the bootstep fences it then
  (:mod:`ax_kombu.celery.fence`: a cancel meanwhile wins, a run never starts before its
  trigger time on the database clock). One already due when it is built has no ``eta``.
  A task for stock workers (``'celery'``) has no fence to refuse it once cancelled, so it is
  claimed only once due on the scheduler's database clock (:mod:`ax_kombu.store.claims`)
  and its message never has an ``eta``: the Celery worker runs it as soon as it reads it.
* ``ax_task_id``, ``ax_attempt`` and ``trace_id`` ride along as extra headers (a Celery
  task sees them as ``self.request.ax_task_id`` …), and so does the W3C trace context
  stored at enqueue (``traceparent``, ``tracestate``: absent when None), where Celery's
  OpenTelemetry instrumentation looks for its parent.
"""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime
from typing import Any, ClassVar, NamedTuple

import orjson

from ax_kombu.broker.messages import ClaimedTask, headers_of
from ax_kombu.core.runners import CELERY, CELERY_AX, route_to

#: the namespace of :func:`celery_task_id` (a fixed, random UUID: never change it)
TASK_ID_NAMESPACE = uuid.UUID("5f0c2b8e-3a51-4c1e-9a57-1d2f6c3b7e90")
#: as Celery's ``argsrepr_maxsize`` / ``kwargsrepr_maxsize`` defaults
_REPR_MAX = 1024
_EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}


class CeleryBound(ClaimedTask):
    """A claimed attempt whose stored runner is ``'celery'``: sent as a Celery message, its
    hand-off recorded by the scheduler (:mod:`ax_kombu.celery.handoff`)."""

    __slots__ = ()
    #: the run is fenced and recorded by a Celery worker's AxBootstep
    fenced: ClassVar[bool] = False


class CeleryFenced(CeleryBound):
    """A claimed attempt whose stored runner is ``'celery_ax'`` (the bootstep records it)."""

    __slots__ = ()
    fenced: ClassVar[bool] = True


#: the message class of each Celery runner (ax_kombu.core.runners.CELERY_RUNNERS)
CELERY_MESSAGES: dict[str, type[CeleryBound]] = {CELERY: CeleryBound, CELERY_AX: CeleryFenced}


class Unbuildable(ValueError):
    """A Celery-bound task's stored payload cannot be sent as a Celery message."""


def processor_for(queue: str, fenced: bool = False) -> str:
    """The ``processor_name`` that marks a task as Celery-bound, for ``queue``; ``fenced``:
    its workers run the bootstep."""
    return route_to(CELERY_AX if fenced else CELERY, queue)


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


def celery_message(m: ClaimedTask, now_ms: float | None = None) -> CeleryMessage:
    """The Celery protocol-2 message for one attempt of a Celery-bound task; its ``eta`` is
    the trigger time when the task is fenced (:class:`CeleryFenced`) and not due yet at
    ``now_ms`` (default: this host's clock), else None (see the module docstring).

    Raises:
        Unbuildable: the payload is not what :mod:`ax_kombu.celery` writes (the reason says
            which part), or the processor names no queue.
    """
    payload = _payload(m.payload)
    args, kwargs = payload.get("args") or [], payload.get("kwargs") or {}
    timelimit = payload.get("timelimit") or [None, None]
    _check_shapes(args, kwargs, timelimit, payload.get("expires"))
    queue = celery_queue(m.processor or "")
    if not queue:
        raise Unbuildable(f"processor {m.processor!r} names no Celery queue")
    task_id = celery_task_id(m.task_id, m.attempt)
    headers: dict[str, Any] = {
        "lang": "py", "task": m.task_type, "id": task_id, "shadow": None,
        "eta": eta_of(m, time.time() * 1000 if now_ms is None else now_ms),
        "expires": payload.get("expires"), "group": None, "group_index": None,
        "retries": 0, "timelimit": timelimit, "root_id": task_id, "parent_id": None,
        "argsrepr": repr(tuple(args))[:_REPR_MAX], "kwargsrepr": repr(kwargs)[:_REPR_MAX],
        "origin": f"ax@{m.node}",
        "ignore_result": bool(payload.get("ignore_result")), "replaced_task_nesting": 0,
        "stamped_headers": None, "stamps": {},
        "ax_task_id": m.task_id, "ax_attempt": m.attempt, **headers_of(m),
    }
    body = orjson.dumps([args, kwargs, _EMBED]).decode()
    return CeleryMessage(queue, body, headers, {"correlation_id": task_id, "reply_to": ""})


def eta_of(m: ClaimedTask, now_ms: float) -> str | None:
    """Celery's ``eta`` header for ``m``: its trigger time (ISO 8601, UTC) when it is staged
    (fenced by the bootstep, and due after ``now_ms``), else None."""
    if not (isinstance(m, CeleryBound) and m.fenced) or m.trigger_time <= now_ms:
        return None
    return datetime.fromtimestamp(m.trigger_time / 1000, UTC).isoformat()


def _payload(raw: Any) -> dict[str, Any]:
    """The stored payload as the object :mod:`ax_kombu.celery` writes, or Unbuildable."""
    try:
        payload = orjson.loads(str(raw)) if isinstance(raw, str) else raw
    except orjson.JSONDecodeError as exc:
        raise Unbuildable(f"the payload is not JSON ({exc})") from None
    if not isinstance(payload, dict):
        raise Unbuildable("a Celery task's payload must be an object "
                          f'{{"args": [...], "kwargs": {{...}}}}, got {type(payload).__name__}')
    return payload


def _check_shapes(args: Any, kwargs: Any, timelimit: Any, expires: Any) -> None:
    if not isinstance(args, list):
        raise Unbuildable(f"payload args must be a list, got {type(args).__name__}")
    if not isinstance(kwargs, dict):
        raise Unbuildable(f"payload kwargs must be an object, got {type(kwargs).__name__}")
    if not (isinstance(timelimit, list) and len(timelimit) == 2 and all(
            t is None or (isinstance(t, (int, float)) and not isinstance(t, bool))
            for t in timelimit)):
        raise Unbuildable("payload timelimit must be [hard, soft] seconds (numbers or null)")
    if expires is not None and not isinstance(expires, str):
        raise Unbuildable(f"payload expires must be an ISO 8601 string, got "
                          f"{type(expires).__name__}")


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
