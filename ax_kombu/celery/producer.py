"""Storing a Celery task call in ax: :func:`enqueue`.

A call becomes one ordinary ax task row (no schema of its own), written by
:meth:`ax_kombu.api.Client.enqueue` and so validated and deduplicated the same way:

* ``task_type`` = the Celery task name (≤ 128 characters);
* ``runner`` = ``'celery'`` (``'celery_ax'`` when the Celery workers run the
  AxBootstep): where the task runs, stored with it — what the scheduler's claim and
  publisher read (:mod:`ax_kombu.broker.celery_wire`); this module is the only writer
  of a Celery runner (:func:`ax_kombu.enqueue` refuses a ``celery:`` processor name);
* ``processor_name`` = ``celery:<queue>``, the queue Celery's router picks for the
  call (``queue=`` to choose another);
* ``payload`` = ``{"args": [...], "kwargs": {...}}``, plus ``"expires"`` (ISO 8601),
  ``"timelimit"`` (``[hard, soft]`` s) and ``"ignore_result"`` when given: JSON values
  only (ax stores the payload as JSON; Celery's JSON extensions for datetime, UUID
  and Decimal are refused with a :class:`~ax_kombu.exceptions.ValidationError`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from celery.utils.time import maybe_make_aware

import ax_kombu
from ax_kombu.api import Client
from ax_kombu.broker.celery_wire import celery_task_id, processor_for
from ax_kombu.core.values import show
from ax_kombu.exceptions import ValidationError
from ax_kombu.views import TaskId


def queue_of(app: Any, name: str, args: Sequence[Any] = (),
             kwargs: Mapping[str, Any] | None = None,
             options: Mapping[str, Any] | None = None, task_type: Any = None) -> str:
    """The name of the Celery queue ``app`` routes a call of ``name`` to, as Celery's
    ``send_task`` does (``queue=`` in ``options``, ``task_routes``, the registered task's
    own ``queue``; else ``task_default_queue``)."""
    options = dict(options or {})
    if task_type is None:  # as send_task does with a task of its registry
        task_type = app.tasks.get(name)
        exec_options = getattr(task_type, "_get_exec_options", None)
        if callable(exec_options):
            defaults = {k: v for k, v in exec_options().items() if v is not None}
            options = {**defaults, **options}
    route = app.amqp.router.route(options, name, args, kwargs, task_type)
    queue = route.get("queue")
    return str(getattr(queue, "name", None) or queue or app.conf.task_default_queue)


def call_payload(args: Any, kwargs: Any, *, expires: Any = None, time_limit: Any = None,
                 soft_time_limit: Any = None, ignore_result: bool = False,
                 now: datetime | None = None) -> dict[str, Any]:
    """The payload of one call (see the module docstring).

    ``expires`` is seconds from now, a datetime or an ISO 8601 string, as for Celery.

    Raises:
        ValidationError: ``args`` not a list or tuple, ``kwargs`` not a mapping, or a
            bad ``expires``.
    """
    if args is None:
        args = ()
    if not isinstance(args, (list, tuple)):
        raise ValidationError(f"Celery task args must be a list or tuple, got {show(args)}")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, Mapping):
        raise ValidationError(f"Celery task kwargs must be a mapping, got {show(kwargs)}")
    payload: dict[str, Any] = {"args": list(args), "kwargs": dict(kwargs)}
    if expires is not None:
        payload["expires"] = _expires(expires, now)
    if time_limit is not None or soft_time_limit is not None:
        payload["timelimit"] = [time_limit, soft_time_limit]
    if ignore_result:
        payload["ignore_result"] = True
    return payload


def _expires(expires: Any, now: datetime | None) -> str:
    if isinstance(expires, str):
        return expires
    if isinstance(expires, datetime):
        if expires.utcoffset() is None:
            raise ValidationError("expires is a naive datetime; pass an aware one")
        return expires.isoformat()
    if isinstance(expires, (int, float, timedelta)) and not isinstance(expires, bool):
        seconds = expires.total_seconds() if isinstance(expires, timedelta) else expires
        return ((now or datetime.now().astimezone()) + timedelta(seconds=seconds)).isoformat()
    raise ValidationError(f"expires must be seconds, a datetime or an ISO 8601 string, "
                          f"got {show(expires)}")


def when(app: Any, eta: Any, countdown: Any) -> dict[str, Any]:
    """``run_at``/``delay`` for :meth:`Client.enqueue` from Celery's ``eta``/``countdown``.

    A naive ``eta`` is UTC, as Celery reads it (``celery.utils.time.maybe_make_aware``);
    a string is ISO 8601. A negative countdown means now.
    """
    if eta is not None and countdown is not None:
        raise ValidationError("give eta or countdown, not both")
    if countdown is not None:
        if isinstance(countdown, bool) or not isinstance(countdown, (int, float, timedelta)):
            raise ValidationError(f"countdown must be seconds, got {show(countdown)}")
        seconds = countdown.total_seconds() if isinstance(countdown, timedelta) else countdown
        return {"delay": max(0.0, float(seconds))}
    if eta is None:
        return {}
    if isinstance(eta, str):
        try:
            eta = datetime.fromisoformat(eta)
        except ValueError:
            raise ValidationError(f"eta is not an ISO 8601 time: {show(eta)}") from None
    if isinstance(eta, datetime) and eta.utcoffset() is None:
        eta = maybe_make_aware(eta, app.timezone)
    return {"run_at": eta}


def enqueue(app: Any, name: str, args: Sequence[Any] = (),
            kwargs: Mapping[str, Any] | None = None, *, eta: datetime | str | None = None,
            countdown: float | timedelta | None = None, queue: str | None = None,
            biz_key: str | None = None, priority: str = "default", expires: Any = None,
            time_limit: float | None = None, soft_time_limit: float | None = None,
            ignore_result: bool = False, trace_id: str | None = None,
            fenced: bool | None = None, client: Client | None = None) -> TaskId:
    """Store a call of the Celery task ``name`` in ax, to be sent to Celery when due.

    Args:
        app: the Celery app (its router picks the queue).
        name: the Celery task's registered name, e.g. ``"app.tasks.send_email"``.
        args, kwargs: the call's arguments: JSON values only.
        eta: a datetime (a naive one is UTC, as for Celery) or ISO 8601; or
        countdown: seconds (or a timedelta) from now on the database clock. Neither:
            now. A past ``eta`` or negative countdown also means now.
        queue: the Celery queue's name (default: where Celery would route the call).
        biz_key: makes the call idempotent per (task name, biz_key), as for
            :func:`ax_kombu.enqueue`.
        priority: ax's priority (``"high"``, ``"default"``, ``"slow"``): the order in which
            a busy scheduler publishes (the Celery queue is ``queue``'s in every case).
        expires, time_limit, soft_time_limit, ignore_result: as for Celery's
            ``apply_async`` (``expires`` counts from now, not from the due time).
        trace_id: as for :func:`ax_kombu.enqueue` (default: a new one).
        fenced: the Celery workers run :class:`~ax_kombu.celery.AxBootstep`, which
            records the run (default: whether ``app``'s worker blueprint has it);
            otherwise the task ends SUCCESS in ax when its message is handed to Celery.
        client: the ax client to write with (default: :func:`ax_kombu.client`).
    Returns:
        The ax task id; ``.created`` is False when it matched an existing task. The Celery
        task id of its first dispatch is ``celery_task_id(task_id, 1)``
        (:func:`async_result`).
    Raises:
        ValidationError: bad input; nothing was written.
    """
    payload = call_payload(args, kwargs, expires=expires, time_limit=time_limit,
                           soft_time_limit=soft_time_limit, ignore_result=ignore_result)
    target = queue or queue_of(app, name, payload["args"], payload["kwargs"])
    fenced = uses_bootstep(app) if fenced is None else fenced
    return (client or ax_kombu.client()).enqueue_to(
        "celery_ax" if fenced else "celery", name, payload, **when(app, eta, countdown),
        priority=priority, biz_key=biz_key, processor=processor_for(target, fenced),
        trace_id=trace_id)


def uses_bootstep(app: Any) -> bool:
    """True when ``app``'s worker blueprint includes :class:`~ax_kombu.celery.AxBootstep`."""
    from ax_kombu.celery.bootstep import AxBootstep

    return any(step is AxBootstep or step in ("ax_kombu.celery.bootstep:AxBootstep",
                                              "ax_kombu.celery:AxBootstep")
               for step in app.steps["worker"])


def async_result(app: Any, task_id: int, attempt: int = 1) -> Any:
    """Celery's ``AsyncResult`` for one attempt (default: the first) of the ax task
    ``task_id``. A task is dispatched again (a new attempt, a new Celery id) only if its
    first publish did not certainly reach the broker; the id its last dispatch used is in
    ``ax.get(task_id).result["celery_task_id"]``."""
    return app.AsyncResult(celery_task_id(int(task_id), attempt))
