"""Routing a Celery app's own delayed calls through ax: :func:`install`.

The hook is the app's ``send_task`` method, wrapped on the app instance. It is the
one public method every call path of Celery goes through — ``Task.apply_async``,
``Task.delay``, ``Signature.apply_async`` and ``app.send_task`` — and it still
receives ``eta``/``countdown`` as arguments, before Celery turns them into a
message. The alternatives do not fit: the ``before_task_publish`` signal sees the
finished message and cannot stop the publish; patching ``Task.apply_async`` misses
``app.send_task``; a custom ``app.amqp.send_task_message`` runs after routing
and message building, with the task id already chosen.

After ``install(app)``, a call with a countdown or an eta is stored in ax
(:func:`ax_kombu.celery.enqueue`, so durable and deduplicated) and returns the
``AsyncResult`` of its first dispatch. Every other call goes to Celery exactly as
before: no countdown/eta, eager mode (handled by ``apply_async`` before
``send_task``), and calls ax cannot represent — callbacks or errbacks (``link``,
``link_error``), chords, chains, groups, an explicit ``task_id``, ``shadow``,
custom ``headers``, and ``Task.retry()`` (``retries`` > 0, same id).
Two ax-only options: ``ax_biz_key`` (idempotent per task name and key) and
``ax_priority``; they are dropped when the call goes to Celery.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from ax_kombu.api import Client
from ax_kombu.broker.celery_wire import celery_task_id
from ax_kombu.celery.producer import enqueue, queue_of

log = logging.getLogger(__name__)

#: options that mean "not for ax" when set (truthy)
_CELERY_ONLY = ("link", "link_error", "chord", "chain", "group_id", "group_index", "task_id",
                "shadow", "headers", "retries", "parent_id", "root_id", "replaced_task_nesting",
                "stamped_headers")
#: routing options, passed to Celery's router to find the queue
_ROUTING = ("queue", "routing_key", "exchange", "exchange_type")
_AX_OPTIONS = ("ax_biz_key", "ax_priority")
_MARK = "__ax_original__"


def installed(app: Any) -> bool:
    """True when :func:`install` has been applied to ``app``."""
    return hasattr(app.send_task, _MARK)


def install(app: Any, *, client: Client | None = None, fenced: bool | None = None) -> None:
    """Route ``app``'s calls with a countdown or eta through ax (see the module docstring).

    Idempotent. ``client``: the ax client to write with (default:
    :func:`ax_kombu.client`, configured by ``AX_*`` variables or :func:`ax_kombu.configure`).
    ``fenced``: as for :func:`ax_kombu.celery.enqueue`.
    """
    if installed(app):
        return
    original: Callable[..., Any] = app.send_task

    @functools.wraps(original)
    def send_task(name: str, args: Any = None, kwargs: Any = None, countdown: Any = None,
                  eta: Any = None, **options: Any) -> Any:
        ax_options = {k: options.pop(k) for k in _AX_OPTIONS if k in options}
        why = _not_for_ax(countdown, eta, options)
        if why:
            if countdown or eta is not None:
                log.debug("delayed Celery call left to Celery", extra={"task": name,
                                                                       "reason": why})
            return original(name, args, kwargs, countdown=countdown, eta=eta, **options)
        return _store(app, client, name, args, kwargs, countdown, eta, options,
                      {**ax_options, "fenced": fenced})

    setattr(send_task, _MARK, original)
    app.send_task = send_task


def uninstall(app: Any) -> None:
    """Undo :func:`install` on ``app`` (nothing if it was not installed)."""
    if installed(app):
        app.send_task = getattr(app.send_task, _MARK)


def _not_for_ax(countdown: Any, eta: Any, options: dict[str, Any]) -> str | None:
    if not countdown and eta is None:
        return "no countdown or eta"
    for key in _CELERY_ONLY:
        if options.get(key):
            return key
    return None


def _store(app: Any, client: Client | None, name: str, args: Any, kwargs: Any,
           countdown: Any, eta: Any, options: dict[str, Any],
           ax_options: dict[str, Any]) -> Any:
    routing = {k: options[k] for k in _ROUTING if options.get(k) is not None}
    queue = queue_of(app, name, args or (), kwargs, routing, options.get("task_type"))
    task_id = enqueue(app, name, args or (), kwargs, countdown=countdown or None,
                      eta=None if countdown else eta, queue=queue,
                      biz_key=ax_options.get("ax_biz_key"),
                      priority=ax_options.get("ax_priority") or "default",
                      expires=options.get("expires"), time_limit=options.get("time_limit"),
                      soft_time_limit=options.get("soft_time_limit"),
                      ignore_result=bool(options.get("ignore_result")),
                      fenced=ax_options.get("fenced"), client=client)
    result_cls = options.get("result_cls") or app.AsyncResult
    return result_cls(celery_task_id(task_id, 1))
