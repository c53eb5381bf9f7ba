"""What a processor is given besides its payload: the run's :class:`Context`, with its
:class:`Cancellation` signal. Pure (no I/O): a producer may import it (``ax.Context`` in a typed task's signature) without loading the worker."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import NamedTuple

_cancel_lock = threading.Lock()


class Cancellation:
    """A run's cancellation signal: set when the run should stop early.

    Set (once, with a reason) when the run overruns its ``timeout_ms``
    (``"timeout"``), when its task is cancelled with ``ax cancel`` while
    RUNNING (``"cancelled"``), or when the worker stops cold (``"shutdown"``).
    A Python thread cannot be killed: a long processor should look at
    ``ctx.cancelled`` (or ``ctx.cancelled.wait(seconds)`` instead of sleeping)
    and return. An ``async def`` processor is cancelled instead: the ``await`` in
    progress raises :class:`asyncio.CancelledError` (or it awaits
    :meth:`wait_async`). Cheap to make: one is made per run.
    """

    __slots__ = ("_event", "_hooks", "reason")

    def __init__(self) -> None:
        #: why it was set (None: not set)
        self.reason: str | None = None
        self._event: threading.Event | None = None
        #: called once when the signal is set (None: none registered)
        self._hooks: list[Callable[[], None]] | None = None

    def set(self, reason: str) -> None:
        """Set the signal (the first reason given is kept); the first call runs the hooks
        (:meth:`on_set`) on the calling thread."""
        with _cancel_lock:
            first = self.reason is None
            if first:
                self.reason = reason
            event, hooks = self._event, self._hooks
            if first:
                self._hooks = None
        if event is not None:
            event.set()
        if first and hooks:
            for hook in hooks:
                hook()

    def on_set(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` once when the signal is set, on the thread that sets it (now, on
        this thread, if it is set already). A hook must be quick and must not raise: the
        worker's hook cancels an ``async def`` run's asyncio task."""
        with _cancel_lock:
            if self.reason is None:
                if self._hooks is None:
                    self._hooks = []
                self._hooks.append(hook)
                return
        hook()

    async def wait_async(self, timeout: float | None = None) -> bool:
        """:meth:`wait` for an ``async def`` processor, without blocking its event loop:
        True once the signal is set, False after ``timeout`` seconds. (A run's own signal
        also cancels its coroutine, so this mostly serves signals a processor makes.)"""
        import asyncio  # only a coroutine needs it: importing ax_kombu stays light

        if self.reason is not None:
            return True
        loop = asyncio.get_running_loop()
        woken = loop.create_future()

        def wake() -> None:
            if not woken.done():
                woken.set_result(True)

        def wake_soon() -> None:
            if not loop.is_closed():
                loop.call_soon_threadsafe(wake)

        self.on_set(wake_soon)
        try:
            return await asyncio.wait_for(asyncio.shield(woken), timeout)
        except TimeoutError:
            return self.reason is not None
        finally:
            self._discard(wake_soon)  # a loop of short waits keeps no hook per wait

    def _discard(self, hook: Callable[[], None]) -> None:
        """Forget a hook :meth:`on_set` registered (none: nothing happens)."""
        with _cancel_lock:
            if self._hooks is not None and hook in self._hooks:
                self._hooks.remove(hook)

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
