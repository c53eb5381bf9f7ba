"""The module-level producer API, :mod:`ax_kombu`'s functions (``ax.enqueue``, ``ax.get``,
``ax.schedule``…): each calls the same method of the process's client, :func:`client`
(one :class:`~ax_kombu.api.Client` per process, made on first use from ``AX_*`` variables
and :func:`configure`'s settings, and again after a fork), which documents what it
guarantees. The client lives here; the settings it is made from are
:data:`ax_kombu.config.process_overrides` (:mod:`ax_kombu.aio`'s clients read them too).
Imported into :mod:`ax_kombu`, where users call them and where ``help()`` shows them
(their ``__module__`` is ``ax_kombu``).
"""

from __future__ import annotations

import atexit
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any, ParamSpec, TypeVar

from ax_kombu import config
from ax_kombu import tasks as _tasks
from ax_kombu.api import Client
from ax_kombu.config import Settings, from_env
from ax_kombu.core.backoff import Backoff
from ax_kombu.moving import UNCHANGED as _UNCHANGED
from ax_kombu.recurring import JobView
from ax_kombu.store.pauses import Pause
from ax_kombu.tasks import Task
from ax_kombu.views import TaskId, TaskView

__all__ = [
    "alerts", "cancel", "cancel_many", "client", "configure", "enqueue", "enqueue_many", "get",
    "jobs", "limits", "next_fires", "pause", "pause_queue", "pause_type", "pauses", "processor",
    "remove_alert", "reschedule", "resume", "resume_queue", "resume_type", "run_now",
    "schedule", "set_alert", "set_limit", "task", "unschedule", "wait",
]

#: guards the process client's creation and replacement
_lock = threading.Lock()
_client: Client | None = None


def configure(**settings: Any) -> Settings:
    """Override settings for this process (above ``AX_*`` variables); returns them.

    Raises:
        ConfigurationError: an unknown or invalid setting.
    """
    global _client
    resolved = from_env(**{**config.process_overrides, **settings})
    with _lock:
        config.process_overrides.update(settings)
        if _client is not None:
            _client.close()
            _client = None
    return resolved


def client() -> Client:
    """This process's producer client, created on first use (and again after fork)."""
    global _client
    with _lock:
        if _client is None or _client.pid != os.getpid():
            _client = Client(from_env(**config.process_overrides))
        return _client


@atexit.register
def _close() -> None:
    if _client is not None and _client.pid == os.getpid():
        _client.close()


F = TypeVar("F", bound=Callable[..., Any])
P = ParamSpec("P")
R = TypeVar("R")


def enqueue(task_type: str, payload: Any = None, *, run_at: datetime | None = None,
            delay: float | timedelta | None = None, priority: str = "default",
            biz_key: str | None = None, max_retry: int | None = None,
            timeout_ms: int | None = None, processor: str | None = None,
            callback_url: str | None = None, trace_id: str | None = None,
            order_key: str | None = None, order_policy: str = "hold_failed",
            shards: int | str | None = None, unique: str = "always",
            on_conflict: str = "keep", connection: Any = None) -> TaskId:
    """Schedule one task.

    Args:
        task_type: what kind of task (≤ 128 characters); also the default processor name.
        payload: any JSON value passed to the processor: string keys, no NaN/Infinity,
            integers within 64 bits, ≤ 32 levels deep, ≤ AX_MAX_PAYLOAD_BYTES encoded.
        run_at: an aware datetime to run at (a past one means now); or
        delay: seconds (or a timedelta) from now on the database clock. Neither: now.
            Either reaches at most 3650 days ahead.
        priority: "high", "default" or "slow" — the queue it is dispatched to.
        biz_key: makes enqueue idempotent per (task_type, biz_key); ≤ 255 characters.
        unique: with a biz_key, ``"always"`` (default: the key is kept for good) or
            ``"pending"`` (kept only until its task finishes; then a new task takes it).
        on_conflict: with a biz_key, ``"keep"`` (default: the existing task stays as it
            is) or ``"replace"`` (a holder that has not started takes this payload and
            time, as :func:`reschedule` moves it: a debounce; ``.replaced`` is True).
        max_retry: retries after a failure, 0..1000 (default AX_DEFAULT_MAX_RETRY).
        timeout_ms: how long one run may take, 1 ms..7 days (default AX_DEFAULT_TIMEOUT_MS).
        processor: a registered name or ``package.module:function`` (≤ 255); or
        callback_url: an http(s) URL with a host to POST the payload to (≤ 2048).
        trace_id: carried into logs and messages (default: a new one); ≤ 32 of
            ``[A-Za-z0-9._:-]``.
        order_key: tasks with the same key run one at a time, in trigger order (ties by
            id), across the cluster; ≤ 255 characters.
        order_policy: ``"hold_failed"`` (default: a failed task that will retry keeps the
            key, later ones wait) or ``"skip_failed"`` (later ones go on meanwhile).
        shards: make this many tasks at once (1..1024), identical but for
            ``ctx.shard_index`` (0..N-1) and ``ctx.shard_total``; or ``"workers"``: one
            task per live worker consuming the priority's queue, resolved when it is
            dispatched, each run on its worker (a worker that dies before its shard
            starts: the shard goes to another one).
        connection: write in the caller's transaction instead of one of ax's own: a
            SQLAlchemy Connection or Session on the ax database, a psycopg2 or psycopg 3
            connection, or ``django.db.connection`` inside ``atomic()``. The task commits
            or rolls back with the caller's writes (:mod:`ax_kombu.store.borrowed` says
            what holds, and which locks last until the commit).
    Returns:
        The task id, an int; ``.created`` is False if it duplicated an existing task;
        ``.replaced`` is True if it replaced one; with ``shards``, it is shard 0's and
        ``.shards`` lists every shard's id.
    Raises:
        ValidationError: bad input, or a ``connection`` that cannot be used; nothing was
            written.
    """
    return client().enqueue(task_type, payload, run_at=run_at, delay=delay, priority=priority,
                            biz_key=biz_key, max_retry=max_retry, timeout_ms=timeout_ms,
                            processor=processor, callback_url=callback_url, trace_id=trace_id,
                            order_key=order_key, order_policy=order_policy, shards=shards,
                            unique=unique, on_conflict=on_conflict, connection=connection)


def enqueue_many(items: Iterable[Mapping[str, Any]], *, connection: Any = None) -> list[TaskId]:
    """Schedule many tasks in one transaction (with ``connection``, the caller's, as for
    :func:`enqueue`); each item holds :func:`enqueue`'s arguments.

    Raises:
        ValidationError: any item is invalid (the message names it); nothing was written.
    """
    return client().enqueue_many(items, connection=connection)


def get(task_id: int) -> TaskView:
    """A read-only view of the task. Raises TaskNotFound."""
    return client().get(task_id)


def wait(task_id: int, timeout: float = 30.0) -> TaskView:
    """Wait until the task has finished; returns it (``.result`` holds what the processor
    returned). On PostgreSQL it is woken by the end's ``NOTIFY ax_ended`` (re-reading the
    row each second besides); on SQLite it polls. Raises TaskNotFound, or WaitTimeout after
    ``timeout`` seconds."""
    return client().wait(task_id, timeout)


def cancel(task_id: int | None = None, *, task_type: str | None = None,
           biz_key: str | None = None) -> TaskView:
    """Cancel a task that has not finished, named by its id or by ``(task_type, biz_key)``.
    A task staged on a worker is stopped before it starts; a running one sees
    ``ctx.cancelled``.

    Raises:
        ValidationError: both or neither ways of naming the task.
        TaskNotFound: no such task.
        IllegalTransition: it has already finished.
    """
    return client().cancel(task_id, task_type=task_type, biz_key=biz_key)


def cancel_many(*, task_type: str | None = None, status: str | None = None,
                biz_keys: Iterable[str] | None = None,
                since: float | timedelta | None = None) -> int:
    """Cancel every unfinished task matching all the filters given (as ``ax list``'s);
    returns how many.

    Args:
        task_type: only tasks of this type.
        status: only tasks in this (unfinished) status.
        biz_keys: only tasks holding one of these keys.
        since: only tasks created within the last ``since`` seconds (or timedelta).
    Raises:
        ValidationError: neither task_type nor biz_keys, a final status, a bad filter;
            nothing changed.
    """
    return client().cancel_many(task_type=task_type, status=status, biz_keys=biz_keys,
                                since=since)


def reschedule(task_id: int | None = None, *, task_type: str | None = None,
               biz_key: str | None = None, run_at: datetime | None = None,
               delay: float | timedelta | None = None, payload: Any = _UNCHANGED) -> TaskView:
    """Move a task that has not started to ``run_at`` (or ``delay`` from now), and give it
    ``payload`` if given. One compare-and-set decides: the task then runs at the new time
    and never at the old one (:mod:`ax_kombu.store.moves`); the move is kept in
    ``TaskView.moves``.

    Raises:
        ValidationError: bad arguments (both or neither ways of naming the task, neither
            run_at nor delay…); nothing changed.
        TaskNotFound: no such task.
        TooLateToMove: it is claimed, staged on a worker for its start, or running.
        IllegalTransition: it has finished.
    """
    return client().reschedule(task_id, task_type=task_type, biz_key=biz_key, run_at=run_at,
                               delay=delay, payload=payload)


def run_now(task_id: int | None = None, *, task_type: str | None = None,
            biz_key: str | None = None) -> TaskView:
    """Move a task that has not started to now; raises as :func:`reschedule`."""
    return client().run_now(task_id, task_type=task_type, biz_key=biz_key)


def schedule(name: str, task_type: str, payload: Any = None, *, cron: str | None = None,
             every: float | timedelta | None = None, tz: str = "UTC",
             misfire: str = "fire_once", misfire_grace_s: float | None = None,
             strategy: str = "parallel", priority: str = "default", max_retry: int | None = None,
             timeout_ms: int | None = None, processor: str | None = None,
             callback_url: str | None = None) -> JobView:
    """Create or update the recurring job ``name`` (an idempotent upsert by name).

    Each occurrence becomes an ordinary task of ``task_type`` with ``payload``; its
    processor sees ``ctx.job`` and ``ctx.scheduled_at``. Exactly one task is created per
    occurrence, whatever the number of schedulers. Calling it again with the same
    arguments changes nothing; with new ones it re-plans the job (a paused job stays
    paused).

    Args:
        name: the job's unique name (≤ 128 characters).
        task_type, payload, priority, max_retry, timeout_ms, processor, callback_url:
            as for :func:`enqueue`, for every occurrence.
        cron: 5 fields (minute hour day month weekday), or 6 with seconds first,
            e.g. ``"0 8 * * *"`` or ``"*/10 * * * * *"``; or
        every: seconds (or a timedelta), at least 1 s — exactly one of the two.
        tz: the IANA zone the cron expression is read in (DST as cron does:
            :mod:`ax_kombu.core.cron`).
        misfire: what runs after the job missed occurrences (all schedulers down, or
            paused): ``"fire_once"`` (default: one catch-up run), ``"skip"`` (none),
            ``"fire_all"`` (each, oldest first, at most ``AX_MISFIRE_MAX``).
        misfire_grace_s: missed occurrences older than this are not run (None: no limit).
        strategy: when an occurrence is due while an earlier one is unfinished:
            ``"parallel"`` (default: both run), ``"serial"`` (it waits, then runs, in
            occurrence order), ``"cover"`` (it runs; the earlier one is cancelled, or
            signalled if running, and recorded as superseded), ``"discard"`` (it is
            cancelled).
    Returns:
        The job as stored.
    Raises:
        ValidationError: bad input (a bad cron expression, an unknown zone, both or
            neither of cron/every…); nothing was written.
    """
    return client().schedule(name, task_type, payload, cron=cron, every=every, tz=tz,
                             misfire=misfire, misfire_grace_s=misfire_grace_s,
                             strategy=strategy, priority=priority, max_retry=max_retry,
                             timeout_ms=timeout_ms, processor=processor,
                             callback_url=callback_url)


def pause(name: str) -> JobView:
    """Pause a recurring job: its undispatched occurrences are removed and none is created
    until :func:`resume`. Raises JobNotFound."""
    return client().pause(name)


def resume(name: str) -> JobView:
    """Resume a paused job; occurrences missed meanwhile go by its misfire policy.
    Raises JobNotFound."""
    return client().resume(name)


def unschedule(name: str) -> int:
    """Remove a recurring job and its occurrences not yet dispatched; returns how many
    occurrences were removed. Raises JobNotFound."""
    return client().unschedule(name)


def jobs() -> list[JobView]:
    """Every recurring job, by name."""
    return client().jobs()


def next_fires(name: str, count: int = 5) -> list[datetime]:
    """The next ``count`` fire times of the job ``name``, as aware datetimes in its zone.
    Raises JobNotFound."""
    return client().next_fires(name, count)


def processor(task_type: str, *, retry_on: tuple[type[BaseException], ...] | None = None,
              backoff: Backoff | None = None) -> Callable[[F], F]:
    """Register the decorated callable as the processor of ``task_type``
    (:func:`ax_kombu.worker.processors.processor` says how ``retry_on`` and ``backoff``
    act). The worker's code is imported here, by the first registration: a producer's
    ``import ax_kombu`` loads neither it nor its HTTP client."""
    from ax_kombu.worker import processors

    return processors.processor(task_type, retry_on=retry_on, backoff=backoff)


def task(task_type: str, *, priority: str = "default", max_retry: int | None = None,
         timeout: float | timedelta | str | None = None,
         retry_on: tuple[type[BaseException], ...] | None = None,
         backoff: Backoff | None = None) -> Callable[[Callable[P, R]], Task[P, R]]:
    """Make the decorated function a typed task of ``task_type``, an :class:`ax.Task`
    (:mod:`ax_kombu.tasks` says how its arguments are bound, stored and passed back):
    ``.enqueue(*args, delay=…|run_at=…, biz_key=…, connection=…, **kwargs)``,
    ``.enqueue_many``, ``.schedule``, ``.aenqueue``; the worker runs it with ``ctx=``.

    Args:
        priority, max_retry: every enqueue's defaults, as for :func:`enqueue`.
        timeout: how long one run may take: seconds, a timedelta, or ``"250ms"``,
            ``"30s"``, ``"5m"``, ``"1h"`` (None: ``AX_DEFAULT_TIMEOUT_MS``).
        retry_on, backoff: as for :func:`processor`.
    Raises:
        ValidationError: a bad argument, or a function with a parameter named like an
            enqueue option; nothing is registered.
    """
    return _tasks.task(task_type, client=client, priority=priority, max_retry=max_retry,
                       timeout=timeout, retry_on=retry_on, backoff=backoff)


def set_limit(task_type: str, max_running: int | None) -> None:
    """At most ``max_running`` tasks of ``task_type`` DISPATCHING or RUNNING at once, across
    the cluster (None: no limit). Tasks over it wait READY and start as runs end.

    Raises:
        ValidationError: not a task type, or ``max_running`` not an int ≥ 1 (or None).
    """
    client().set_limit(task_type, max_running)


def limits() -> dict[str, int]:
    """Every cluster-wide limit: task type → most running at once."""
    return client().limits()


def pause_type(task_type: str) -> bool:
    """Pause ``task_type`` cluster-wide: the schedulers leave its tasks waiting, unclaimed
    (DELAYED/READY) and visibly late, until :func:`resume_type`; runs already claimed are
    not recalled. Recorded in the audit as the OS user. Returns False if already paused.

    Raises:
        ValidationError: not a task type name; nothing was written.
    """
    return client().pause_type(task_type)


def resume_type(task_type: str) -> bool:
    """Lift the pause of ``task_type``: its waiting tasks are claimed and run, each once.
    Returns False if it was not paused."""
    return client().resume_type(task_type)


def pause_queue(queue: str) -> bool:
    """Pause a queue (by its configured name, e.g. ``AX_QUEUE_SLOW``'s) cluster-wide, as
    :func:`pause_type` does a type. Raises ValidationError for an unknown queue name."""
    return client().pause_queue(queue)


def resume_queue(queue: str) -> bool:
    """Lift the pause of a queue; returns False if it was not paused."""
    return client().resume_queue(queue)


def pauses() -> list[Pause]:
    """Every paused type and queue (``kind``, ``name``, ``paused_at`` epoch ms, ``actor``)."""
    return client().pauses()


def set_alert(task_type: str, *, on: Iterable[str] | str | None = None,
              late_after: float | timedelta | str | None = None, webhook: str,
              secret: str | None = None) -> str:
    """Alert ``webhook`` when tasks of ``task_type`` fail or start late: one signed message
    when an incident opens, one when ``AX_ALERT_QUIET_MS`` without a new event closes it
    (docs/alerts.md). Setting it again changes it (its open incident and secret stay).

    Args:
        on: ``"failed"`` (a task ended FAILED, retries spent) and/or ``"late"`` (not
            started ``late_after`` past its trigger time); None: ``failed``, and ``late``
            too when ``late_after`` is given.
        late_after: with ``"late"``: seconds, a timedelta, or ``"30s"``, ``"5m"``…
        webhook: the http(s) URL POSTed to.
        secret: the Standard Webhooks signing key (``whsec_`` + base64); None: a new one
            (or the alert's current one).
    Returns:
        The signing secret, for the receiver's ``standardwebhooks.Webhook(secret)``.
    Raises:
        ValidationError: a bad type, event, duration, URL or secret; nothing is written.
    """
    return client().set_alert(task_type, on=on, late_after=late_after, webhook=webhook,
                              secret=secret)


def remove_alert(task_type: str) -> bool:
    """Remove the alert of ``task_type``; False if there was none."""
    return client().remove_alert(task_type)


def alerts() -> list[dict[str, Any]]:
    """Every per-type alert (without secrets) and its open incident, if any."""
    return client().alerts()


for _name in __all__:  # documented, shown and pickled as ax_kombu's, where they are called
    globals()[_name].__module__ = "ax_kombu"
