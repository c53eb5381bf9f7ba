"""ax — a distributed timed-task scheduler on Kombu.

The public API::

    import ax_kombu as ax

    @ax.task("order.close", priority="high", max_retry=3, timeout="30s")
    def close(order: int, *, ctx: ax.Context) -> None: ...     # a typed task

    task_id = close.enqueue(42, delay=1800, biz_key="o-42")    # arguments checked at once
    task_id = await close.aenqueue(42, delay=1800)             # or from asyncio (ax.aio)
    ax.get(task_id).status
    ax.cancel(task_id)

    ax.configure(database_url="postgresql://127.0.0.1/app")   # optional
    ax.enqueue("order.close", {"order": 42}, delay=1800)        # the raw form

    @ax.processor("report.build")
    def build(payload, ctx): ...

    ax.schedule("report.daily", "report.build", {"kind": "daily"},
                cron="0 8 * * *", tz="Asia/Shanghai")        # a recurring job
    ax.pause("report.daily"); ax.resume("report.daily"); ax.unschedule("report.daily")

    @ax.periodic(cron="*/10 * * * * *", name="cache.refresh")
    def refresh(payload, ctx): ...                          # ctx.job, ctx.scheduled_at

mypy checks a typed task's arguments with ``plugins = ax_kombu.mypy_plugin``
(:mod:`ax_kombu.tasks`).
"""

from __future__ import annotations

from typing import Any

from ax_kombu.config import Settings
from ax_kombu.core.backoff import Backoff
from ax_kombu.core.context import Context
from ax_kombu.core.states import Status
from ax_kombu.exceptions import (
    AxError,
    Discard,
    IllegalTransition,
    JobNotFound,
    Retry,
    Snooze,
    TaskNotFound,
    TooLateToMove,
    ValidationError,
    WaitTimeout,
)
from ax_kombu.facade import (
    alerts,
    cancel,
    cancel_many,
    client,
    configure,
    enqueue,
    enqueue_many,
    get,
    jobs,
    limits,
    next_fires,
    pause,
    pause_queue,
    pause_type,
    pauses,
    processor,
    remove_alert,
    reschedule,
    resume,
    resume_queue,
    resume_type,
    run_now,
    schedule,
    set_alert,
    set_limit,
    task,
    unschedule,
    wait,
)
from ax_kombu.recurring import JobView, periodic
from ax_kombu.tasks import Task, TaskCall
from ax_kombu.views import AttemptView, Move, TaskId, TaskView

__all__ = [
    "AsyncClient", "AttemptView", "AxError", "Backoff", "Context", "Discard",
    "IllegalTransition", "JobNotFound", "JobView", "Move", "Retry", "Settings", "Snooze",
    "Status", "Task", "TaskCall", "TaskId", "TaskNotFound", "TaskView", "TooLateToMove",
    "ValidationError", "WaitTimeout", "aio", "alerts", "cancel", "cancel_many", "client",
    "configure", "enqueue", "enqueue_many", "get", "jobs", "limits", "next_fires", "pause",
    "pause_queue", "pause_type", "pauses", "periodic", "processor", "remove_alert",
    "reschedule", "resume", "resume_queue", "resume_type", "run_now", "schedule",
    "set_alert", "set_limit", "task", "unschedule", "wait",
]
__version__ = "0.1.0"

def __getattr__(name: str) -> Any:
    """``ax.celery`` (:mod:`ax_kombu.celery`), ``ax.aio`` and ``ax.AsyncClient``
    (:mod:`ax_kombu.aio`), imported on first use: ``import ax_kombu`` imports neither
    Celery nor SQLAlchemy's asyncio (optional extras; without one, ImportError says how
    to install it)."""
    import importlib

    if name in ("celery", "aio"):
        return importlib.import_module(f"ax_kombu.{name}")
    if name == "AsyncClient":
        return importlib.import_module("ax_kombu.aio").AsyncClient
    raise AttributeError(f"module 'ax_kombu' has no attribute {name!r}")
