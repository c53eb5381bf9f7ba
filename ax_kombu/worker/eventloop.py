"""The worker's event loop: one asyncio loop per worker process, on a daemon thread, that
runs the ``async def`` processors (deferred runs, :class:`~ax_kombu.worker.executor.Deferred`).

Guarantees:

* **One report per run.** :meth:`EventLoop.run` makes the run's coroutine into an asyncio
  task; its end (its value, or what it raised, :class:`asyncio.CancelledError` included)
  is reported exactly once to the run's ``ended``, on the loop's thread. A run handed over
  after :meth:`EventLoop.stop` ends at once with an error, its body not started.
* **Cancellation.** Setting the run's signal (a timeout, ``ax cancel``, a shutdown)
  cancels its task: the ``await`` in progress raises ``CancelledError``, which is reported
  with the signal's reason. A coroutine that swallows it goes on until it returns.
* **Cheap hand-over.** Runs handed over from pool threads are queued, and the loop is
  woken once per batch, not once per run. A pool may be *fed* to the loop instead
  (:meth:`EventLoop.feed`): the loop itself takes the pool's due ``on_loop`` jobs, as many as
  its slots allow, and starts their runs on its own thread (:meth:`EventLoop.run_here`), with
  no pool thread between the stage and the coroutine.
* The slots that bound how many runs go on at once are the pool's (each run keeps its
  slot until its end is reported), not this loop's.

The loop starts on first use and stops last at the worker's stop, after the pools
(:meth:`EventLoop.stop` cancels what still runs).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Coroutine
from functools import partial
from typing import Any

from ax_kombu.core.context import Cancellation
from ax_kombu.worker.executor import Ended, Feedable

log = logging.getLogger(__name__)

#: what a deferred run's coroutine is made by (called on the loop's thread)
Body = Callable[[], Coroutine[Any, Any, Any]]

#: how long :meth:`EventLoop.stop` waits for cancelled runs to report their end
STOP_WAIT_S = 2.0


class EventLoopStopped(RuntimeError):
    """A run was handed to the event loop after it stopped: its body never started."""


class EventLoop:
    """One asyncio loop on a daemon thread (see the module docstring).

    Args:
        name: the loop thread's name.
    """

    def __init__(self, name: str = "ax-event-loop") -> None:
        self._name = name
        self._lock = threading.Lock()
        self._pending: list[tuple[Body, Ended, Cancellation | None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped = False

    def run(self, body: Body, ended: Ended, cancel: Cancellation | None = None) -> None:
        """Run ``body()``'s coroutine on the loop and report its end to ``ended`` (any
        thread; returns at once). ``cancel``, when set, cancels it."""
        with self._lock:
            if self._stopped:
                stopped = True
            else:
                stopped = False
                loop = self._loop or self._start()
                self._pending.append((body, ended, cancel))
                wake = len(self._pending) == 1
        if stopped:
            ended(None, EventLoopStopped("the worker's event loop is stopped"))
        elif wake:
            loop.call_soon_threadsafe(self._launch)

    def run_here(self, body: Body, ended: Ended, cancel: Cancellation | None = None) -> None:
        """:meth:`run` from the loop's own thread (a fed pool's job): the task is made now."""
        loop = self._loop
        assert loop is not None  # a feed's call: the loop runs
        task = loop.create_task(_guarded(body, ended, cancel))
        if cancel is not None:
            cancel.on_set(partial(_cancel_soon, loop, task))

    def feed(self, source: Feedable) -> Callable[[], None]:
        """Let the loop take ``source``'s ``on_loop`` jobs; returns what wakes it to look
        (any thread; a burst of pokes costs one turn of the loop)."""
        return _Feed(self, source).poke

    def call_soon(self, callback: Callable[[], None]) -> bool:
        """Call ``callback`` on the loop's thread soon (any thread; the loop starts on first
        use); False once the loop is stopped."""
        with self._lock:
            if self._stopped:
                return False
            loop = self._loop or self._start()
        try:
            loop.call_soon_threadsafe(callback)
        except RuntimeError:  # closed meanwhile
            return False
        return True

    def call_later(self, delay_s: float, callback: Callable[[], None]) -> bool:
        """Call ``callback`` on the loop's thread after ``delay_s`` (from the loop's thread);
        False once the loop is stopped."""
        loop = self._loop
        if self._stopped or loop is None:
            return False
        loop.call_later(delay_s, callback)
        return True

    def _start(self) -> asyncio.AbstractEventLoop:
        """Make the loop and its thread (the caller has the lock)."""
        loop = self._loop = asyncio.new_event_loop()
        loop.set_exception_handler(_log_loop_error)
        self._thread = threading.Thread(target=loop.run_forever, name=self._name, daemon=True)
        self._thread.start()
        return loop

    def _launch(self) -> None:
        """The loop's thread: the runs handed over since the last wake-up become tasks."""
        with self._lock:
            batch, self._pending = self._pending, []
        loop = self._loop
        assert loop is not None
        for body, ended, cancel in batch:
            # asyncio keeps every task (asyncio.all_tasks): no set of ours, and no done
            # callback, which would cost each run one more turn of the loop
            task = loop.create_task(_guarded(body, ended, cancel))
            if cancel is not None:
                cancel.on_set(partial(_cancel_soon, loop, task))

    def stop(self, timeout_s: float = STOP_WAIT_S) -> None:
        """Refuse new runs, cancel those still going (each reports its end), stop the loop
        and its thread (within about ``timeout_s``). Idempotent."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        asyncio.run_coroutine_threadsafe(self._drain(timeout_s), loop)
        thread.join(timeout_s + 1.0)
        if not thread.is_alive():
            loop.close()

    async def _drain(self, timeout_s: float) -> None:
        """Cancel every run, wait (bounded) for their reports, stop the loop."""
        self._launch()  # handed over before the stop: they start and are cancelled
        tasks = asyncio.all_tasks() - {asyncio.current_task()}
        for task in tasks:
            task.cancel()
        if tasks:
            _, going = await asyncio.wait(tasks, timeout=timeout_s)
            if going:
                log.warning("runs still going when the event loop stopped",
                            extra={"count": len(going)})
        asyncio.get_running_loop().stop()


class _Feed:
    """Takes a pool's due ``on_loop`` jobs on the loop's thread (:meth:`EventLoop.feed`):
    when poked (jobs staged, a slot freed, a signal set) and at the next one's start time."""

    __slots__ = ("_at", "_owner", "_poked", "_source", "_timer")

    def __init__(self, owner: EventLoop, source: Feedable) -> None:
        self._owner = owner
        self._source = source
        self._poked = False
        self._timer: asyncio.TimerHandle | None = None
        self._at = 0.0

    def poke(self) -> None:
        """Any thread: look at the pool soon (once for every poke until then)."""
        if not self._poked:
            self._poked = True
            if not self._owner.call_soon(self._take):
                self._poked = False  # stopped: the pool's abandon reports what is left

    def _take(self) -> None:
        """The loop's thread: start what is due, and wait for the next start time."""
        self._poked = False
        source = self._source
        jobs, next_at = source.take_loop()
        for job in jobs:
            source.launch(job)
        if next_at is None or (self._timer is not None and self._at <= next_at):
            return
        if self._timer is not None:
            self._timer.cancel()
        self._at = next_at
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(max(0.0, next_at - source.clock()), self._on_time)

    def _on_time(self) -> None:
        self._timer = None
        self._take()


async def _guarded(body: Body, ended: Ended, cancel: Cancellation | None) -> None:
    """Await ``body()`` and report its end once; a cancellation is reported with the
    signal's reason (never as a success)."""
    try:
        value = await body()
    except asyncio.CancelledError:
        reason = cancel.reason if cancel is not None else None
        ended(None, asyncio.CancelledError(f"cancelled: {reason or 'by the event loop'}"))
    except BaseException as exc:  # any error is the run's outcome
        ended(None, exc)
        if not isinstance(exc, Exception):
            raise  # SystemExit, KeyboardInterrupt: reported, and not swallowed
    else:
        ended(value, None)


def _cancel_soon(loop: asyncio.AbstractEventLoop, task: asyncio.Task[None]) -> None:
    """A run's signal was set (any thread): cancel its task on the loop's thread."""
    with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nothing to cancel
        loop.call_soon_threadsafe(task.cancel)


def _log_loop_error(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The loop's own errors (a callback that raised) go to the worker's log."""
    del loop
    log.error("event loop error", exc_info=context.get("exception"),
              extra={"detail": context.get("message")})
