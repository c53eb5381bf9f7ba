"""What a run runs: its task as the started row stores it, by name (:class:`RunTask`).

A message only says "task X, attempt N is due" (its attempt is the fencing token). From
its RUNNING move on, a run's task is the row that move returned
(:class:`~ax_kombu.store.transitions.Started`), with the payload parsed once; the message
keeps only what decides nothing (``dispatched_at``, the dispatching ``node``).
:class:`Ended` is what the result writer reads of a run's task (a :class:`RunTask`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from ax_kombu.broker.messages import TaskMessage
from ax_kombu.core.run_log import RunLogBuffer
from ax_kombu.store.transitions import Started


@dataclass(eq=False, slots=True, kw_only=True)
class RunTask:
    """A started task, from its row (see the module docstring)."""

    task_id: int
    attempt: int
    task_type: str
    payload: Any
    trace_id: str
    trigger_time: int
    timeout_ms: int
    priority: str
    retry_count: int
    max_retry: int
    processor: str | None
    callback_url: str | None
    #: from the message: when it was dispatched, and by which scheduler
    dispatched_at: int
    node: str
    #: the recurring job this task is an occurrence of (None: a one-off task), and the
    #: occurrence's time (epoch ms)
    job: str | None = None
    scheduled_at: int | None = None
    #: claimed by the gated claim: its end wakes what waits on its key or type
    gated: bool = False
    order_key: str | None = None
    shard_index: int | None = None
    shard_total: int | None = None
    #: when the run started (the RUNNING move's time, then the real start: a run staged
    #: ahead of its trigger time starts later than its move was written)
    started_at: int | None = None
    #: the W3C trace context the message carried (its run span's parent or link)
    traceparent: str | None = None
    tracestate: str | None = None
    #: the lines the run logged (:mod:`ax_kombu.worker.runlog`; None: none yet)
    logs: RunLogBuffer | None = None

    @classmethod
    def of(cls, row: Started, message: TaskMessage, payload: Any) -> RunTask:
        """The task of ``row`` (its payload parsed: ``payload``), fenced for ``message``."""
        return cls(task_id=row.task_id, attempt=message.attempt, task_type=row.task_type,
                   payload=payload, trace_id=row.trace_id, trigger_time=row.trigger_time,
                   timeout_ms=row.timeout_ms, priority=row.priority,
                   retry_count=row.retry_count, max_retry=row.max_retry,
                   processor=row.processor_name, callback_url=row.callback_url,
                   dispatched_at=message.dispatched_at, node=message.node, job=row.job,
                   scheduled_at=row.scheduled_at, gated=bool(row.gated),
                   order_key=row.order_key, shard_index=row.shard_index,
                   shard_total=row.shard_total, started_at=row.started_at,
                   traceparent=message.traceparent, tracestate=message.tracestate)


class Ended(Protocol):
    """What the result writer reads of a run's task."""

    @property
    def task_id(self) -> int: ...
    @property
    def attempt(self) -> int: ...
    @property
    def task_type(self) -> str: ...
    @property
    def trace_id(self) -> str: ...
    @property
    def trigger_time(self) -> int: ...
    @property
    def timeout_ms(self) -> int: ...
    @property
    def priority(self) -> str: ...
    @property
    def retry_count(self) -> int: ...
    @property
    def max_retry(self) -> int: ...
    @property
    def processor(self) -> str | None: ...
    @property
    def dispatched_at(self) -> int: ...
    @property
    def started_at(self) -> int | None: ...
    @property
    def gated(self) -> bool: ...
    @property
    def order_key(self) -> str | None: ...
