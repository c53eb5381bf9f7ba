"""Runs started on the event loop: the start protocol of a deferred run.

**A deferred run starts on the loop.** A run whose processor is ``async def``
(:meth:`LoopStarter.processor`, resolved once at submit) is submitted ``on_loop``: the
event loop (:mod:`ax_kombu.worker.eventloop`) takes it from its pool (the same slots) and
runs the checks of :mod:`ax_kombu.worker.starts` on its own thread, none of them waiting
(:meth:`LoopStarter.start`). The rare check that would wait goes elsewhere and the run
starts after it, the same protocol: a trigger time not yet reached on the database clock
(a timer of the loop's), an uncertain lease or a LISTED run's release commit (one of
:data:`BLOCKING_THREADS` threads of the starter's, which runs the thread protocol).

A run that never starts here (the loop stopped, or the worker is stopping before a
thread could take its check) ends with :class:`~ax_kombu.worker.run.Withdrawn`.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, Protocol

from ax_kombu.broker.messages import TaskMessage
from ax_kombu.core.lease import Lease
from ax_kombu.worker.eventloop import EventLoop
from ax_kombu.worker.executor import Deferred
from ax_kombu.worker.executor import Ended as RunEnded
from ax_kombu.worker.lanes import Lane
from ax_kombu.worker.processors import Resolver, is_async
from ax_kombu.worker.receipts import UnreadablePayload
from ax_kombu.worker.run import Run, Withdrawn
from ax_kombu.worker.stage import Stage
from ax_kombu.worker.task import RunTask

#: processors whose kind (sync or async def) a starter remembers
ASYNC_KINDS_MAX = 1024
#: threads that run the start checks a deferred run's start on the loop may not wait for
BLOCKING_THREADS = 4

#: a run's start on an executor's thread (the thread protocol; may wait), with its processor
#: as resolved at submit
Start = Callable[[Run[Lane], Callable[..., Any]], Any]
#: under the stage's lock: STARTED if the run may start now; True if it is LISTED
Take = Callable[[Run[Lane], bool], bool]


class Begin(Protocol):
    """The checks are passed: the run begins (``here``: on the loop's thread)."""

    def __call__(self, run: Run[Lane], left_ms: float, *, here: bool,
                 func: Callable[..., Any] | None = None) -> Any: ...


class LoopStarter:
    """Starts deferred runs on the event loop (see the module docstring); its
    :class:`~ax_kombu.worker.starts.Starter` owns it, and lends it its checks.

    Args:
        loop: the worker's event loop.
        resolver: finds a run's processor (to tell an ``async def`` one).
        clock: the earliest the database time can be, epoch ms, without a round trip.
        lease: the worker's lease, which must cover the run's incarnation.
        stage: the index of runs in the executors, and its lock.
        start: the thread protocol's start (run on a blocking thread when a check waits).
        take: the stage check, called under the stage's lock.
        begin: what starts the run once the checks are passed.
    """

    def __init__(self, *, loop: EventLoop, resolver: Resolver, clock: Callable[[], float],
                 lease: Lease, stage: Stage, start: Start, take: Take, begin: Begin) -> None:
        self._loop = loop
        self._resolver = resolver
        self._clock = clock
        self._lease = lease
        self._stage = stage
        self._start = start
        self._take = take
        self._begin = begin
        self._async_kinds: dict[Callable[..., Any], bool] = {}
        #: where a run started on the loop waits for what the loop may not (made on first use)
        self._blocking: ThreadPoolExecutor | None = None

    def processor(self, task: TaskMessage | RunTask) -> Callable[..., Any] | None:
        """The run's processor, resolved once when the run is submitted (its start calls
        this one); None if it does not resolve, or the payload is unreadable: the run's
        start resolves it again and fails with the reason, on a thread."""
        if type(task.payload) is UnreadablePayload:
            return None
        try:
            return self._resolver.resolve(task.processor, task.callback_url)
        except Exception:  # noqa: BLE001 - the run's own start reports it
            return None

    def is_async(self, func: Callable[..., Any]) -> bool:
        """:func:`~ax_kombu.worker.processors.is_async`, remembered per processor (a run
        asks it each time; a callback's callable is new each time, so the memory is
        bounded)."""
        try:
            return self._async_kinds[func]
        except KeyError:
            if len(self._async_kinds) >= ASYNC_KINDS_MAX:
                self._async_kinds.clear()
            kind = self._async_kinds[func] = is_async(func)
            return kind
        except TypeError:  # an unhashable callable
            return is_async(func)

    def start(self, run: Run[Lane], func: Callable[..., Any]) -> Any:
        """The event loop takes a staged run of an ``async def`` processor (``func``, as
        resolved at submit): the same checks, none waiting on the loop's thread (see the
        module docstring); a check that would wait makes the run a :class:`Deferred` that
        starts after it."""
        task, cancel = run.task, run.cancel
        assert cancel is not None  # given at submit
        left_ms = task.trigger_time - self._clock()
        if left_ms > 0 and not cancel:  # the database clock is behind the pool's: wait on
            return Deferred(partial(self._start_later, run, func, left_ms / 1000.0))
        covered = self._lease.covers(run.incarnation)
        if covered is None and not cancel:
            return Deferred(partial(self.elsewhere, partial(self._start, run, func)))
        with self._stage.lock:
            listed = self._take(run, covered is not False)
        if listed:  # (the thread protocol takes it again: a LISTED run has not moved)
            return Deferred(partial(self.elsewhere, partial(self._start, run, func)))
        return self._begin(run, left_ms, here=True, func=func)

    def _start_later(self, run: Run[Lane], func: Callable[..., Any], delay_s: float,
                     ended: RunEnded) -> None:
        """Start ``run`` on the loop after ``delay_s`` (the loop's thread)."""
        def again() -> None:
            try:
                value = self.start(run, func)
            except BaseException as exc:  # noqa: BLE001 - the run's outcome
                ended(None, exc)
                return
            value.launch(ended)  # a deferred run, or one more wait

        if not self._loop.call_later(delay_s, again):
            ended(None, Withdrawn("the worker's event loop is stopped"))

    def elsewhere(self, start: Callable[[], Any], ended: RunEnded) -> None:
        """Run ``start`` (a run's blocking start, or a sync call) on one of the blocking
        threads; its deferred run, value or error goes on to ``ended``."""
        def on_thread() -> None:
            try:
                value = start()
            except BaseException as exc:  # noqa: BLE001 - the run's outcome
                ended(None, exc)
                return
            if type(value) is Deferred:
                value.launch(ended)
            else:
                ended(value, None)

        if self._blocking is None:
            self._blocking = ThreadPoolExecutor(BLOCKING_THREADS, thread_name_prefix="ax-start")
        try:
            self._blocking.submit(on_thread)
        except RuntimeError as exc:  # shut down: the run never starts
            ended(None, Withdrawn(f"the worker is stopping: {exc}"))

    def stop(self) -> None:
        """Stop the blocking threads (after the event loop: the node's last step)."""
        if self._blocking is not None:
            self._blocking.shutdown(wait=False, cancel_futures=True)
