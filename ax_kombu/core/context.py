"""What a processor is given besides its payload: the run's :class:`Context`, with its
:class:`Cancellation` signal. Pure (no I/O): a producer may import it (``ax.Context`` in a typed task's signature) without loading the worker."""

from __future__ import annotations

import logging
import threading
from typing import NamedTuple

_cancel_lock = threading.Lock()


class Cancellation:
    """A run's cancellation signal: set when the run should stop early.

    Set (once, with a reason) when the run overruns its ``timeout_ms``
    (``"timeout"``), when its task is cancelled with ``ax cancel`` while
    RUNNING (``"cancelled"``), or when the worker stops cold (``"shutdown"``).
    A Python thread cannot be killed: a long processor should look at
    ``ctx.cancelled`` (or ``ctx.cancelled.wait(seconds)`` instead of sleeping)
    and return. Cheap to make: one is made per run.
    """

    __slots__ = ("_event", "reason")

    def __init__(self) -> None:
        #: why it was set (None: not set)
        self.reason: str | None = None
        self._event: threading.Event | None = None

    def set(self, reason: str) -> None:
        """Set the signal (the first reason given is kept)."""
        with _cancel_lock:
            if self.reason is None:
                self.reason = reason
            event = self._event
        if event is not None:
            event.set()

    def is_set(self) -> bool:
        return self.reason is not None

    def __bool__(self) -> bool:
        return self.reason is not None

    def wait(self, timeout: float | None = None) -> bool:
        """Sleep until the signal is set or ``timeout`` seconds pass; True if it is set."""
        with _cancel_lock:
            if self._event is None:
                self._event = threading.Event()
                if self.reason is not None:
                    self._event.set()
            event = self._event
        return event.wait(timeout)


class Context(NamedTuple):
    """What a processor knows about the run it is doing (read-only; a NamedTuple, as one is
    made per run, always built by keywords)."""

    task_id: int
    attempt: int
    trace_id: str
    trigger_time: int
    task_type: str
    retry_count: int
    max_retry: int
    timeout_ms: int
    #: set when the run should stop (timeout, ``ax cancel``, cold shutdown); the worker
    #: always gives one
    cancelled: Cancellation | None = None
    #: when the run's ``timeout_ms`` ends, on ``time.monotonic()``
    deadline: float | None = None
    #: the recurring job this run is an occurrence of (None: a one-off task)
    job: str | None = None
    #: the occurrence's time (epoch ms) — what the job was due at; the trigger time of a
    #: catch-up run after a misfire is later
    scheduled_at: int | None = None
    #: this task's shard (0-based) and how many shards its enqueue made (``shards=N``)
    shard_index: int | None = None
    shard_total: int | None = None

    @property
    def log(self) -> logging.LoggerAdapter[logging.Logger]:
        """A logger for the run's own lines: ``ax.task.<task_type>``, each record carrying
        ``task_id``, ``attempt`` and ``trace_id`` as extra fields. What it logs is kept
        with the run's attempt (``ax inspect ID --logs``), as is anything else the run
        logs. Cheap to take: made on each use (a ``Context`` is a tuple)."""
        return logging.LoggerAdapter(logging.getLogger(f"ax.task.{self.task_type}"), {
            "task_id": self.task_id, "attempt": self.attempt, "trace_id": self.trace_id})
