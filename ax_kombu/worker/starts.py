"""The start protocol: fenced runs go to their executor, and each starts only when it may.

:meth:`Starter.submit` hands FENCED runs to their lane's
:class:`~ax_kombu.worker.executor.Executor` (a free thread, or the stage: runs fenced
ahead of a free thread, see :mod:`ax_kombu.worker.lanes`). A run received before its
trigger time waits in the stage, taking no thread, until that time on the database clock:
it never starts early, and the ``started_at`` its result records is when it really
started.

**Before a run starts** (on its executor's thread, :meth:`Starter._start`) it is checked
once more, in memory and under the stage's lock (:class:`~ax_kombu.worker.stage.Stage`):

1. its trigger time has come (or its signal was set: then it ends without starting);
2. the worker's :class:`~ax_kombu.core.lease.Lease` covers the incarnation that fenced it —
   a worker whose heartbeats stopped succeeding (cut off, or paused past its silence
   window) starts nothing it staged until a beat succeeds, and one declared dead meanwhile
   withdraws it (another node has that task now);
3. it is still waiting (not withdrawn by a stop, not cancelled);
4. a LISTED run is released first (:meth:`~ax_kombu.worker.listing.Listing.release`, one
   commit), so the recovery never takes a started run for an unstarted one.

Then STARTED: its processor is called, or for an ``async def`` one, its coroutine is handed
to the worker's event loop (:mod:`ax_kombu.worker.eventloop`) and the run keeps its slot
until the coroutine ends (a deferred run).

**A deferred run starts on the loop**, by the same checks: :mod:`ax_kombu.worker.loopstarts`.

A run that ends without starting (WITHDRAWN, CANCELLED, ABANDONED) records nothing: its
row is no longer RUNNING at its attempt, or is written back by whoever withdrew it, or
(its timeout passed while it waited: :meth:`Starter.take_expired`) by the node, or by
the recovery.

Every outcome goes to the result writer; the run is settled (its message acked) once the
outcome is durable (:meth:`Starter.take_completed`, on the consuming thread).
"""

from __future__ import annotations

import itertools
import queue
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Protocol

from ax_kombu.broker.messages import TaskMessage
from ax_kombu.core.context import Cancellation, Context
from ax_kombu.core.lease import Lease
from ax_kombu.core.outcomes import Outcome
from ax_kombu.exceptions import ProcessorRefused
from ax_kombu.observability import metrics
from ax_kombu.worker.control import Wakeup
from ax_kombu.worker.eventloop import EventLoop
from ax_kombu.worker.executor import Deferred, Executor, Submission
from ax_kombu.worker.lanes import Lane
from ax_kombu.worker.listing import Listing
from ax_kombu.worker.loopstarts import LoopStarter
from ax_kombu.worker.processors import Resolver, call, call_async
from ax_kombu.worker.receipts import UnreadablePayload
from ax_kombu.worker.run import WAITING, Run, State
from ax_kombu.worker.run import Withdrawn as Withdrawn  # noqa: PLC0414 - re-exported
from ax_kombu.worker.scopes import RunScope, entered
from ax_kombu.worker.stage import Stage
from ax_kombu.worker.task import Ended, RunTask

#: how long a staged run waits for the lease before looking at its signal again
LEASE_WAIT_S = 0.1


class Outcomes(Protocol):
    """Where a started run's outcome goes (:class:`~ax_kombu.worker.results.ResultWriter`)."""

    def put(self, task: Ended, outcome: Outcome,
            on_durable: Callable[[], None] | None = None) -> None: ...


class Starter:
    """Submits fenced runs and runs the start protocol (see the module docstring).

    Args:
        stage: the index of runs in the executors, and its lock.
        executors: each lane's executor (its pool).
        clock: the earliest the database time can be, epoch ms, without a round trip: a
            staged run waits until its trigger time on it.
        now_ms: the database time a run's start is recorded at; the result writer records
            its end on the same clock.
        listing: where LISTED runs are released before they start, and forgotten when they
            end without starting (None: no run is ever listed).
        scopes: what wraps each started run's processor call, outermost first.
    """

    def __init__(self, *, stage: Stage, executors: dict[Lane, Executor], results: Outcomes,
                 resolver: Resolver, wakeup: Wakeup, clock: Callable[[], float],
                 now_ms: Callable[[], float], lease: Lease,
                 listing: Listing | None = None, scopes: Sequence[RunScope] = ()) -> None:
        self._stage = stage
        self._executors = executors
        self._results = results
        self._resolver = resolver
        self._wakeup = wakeup
        self._clock = clock
        self._now_ms = now_ms
        self._lease = lease
        self._listing = listing
        #: what wraps every started run (:mod:`ax_kombu.worker.scopes`)
        self._scopes = tuple(scopes)
        #: runs whose timeout passed while they waited (the lease stayed uncertain, say)
        #: and so never started: their rows are still RUNNING here at their attempt, and
        #: the node writes them back (:meth:`take_expired`), or the recovery does
        self.expired: queue.SimpleQueue[Run[Lane]] = queue.SimpleQueue()
        self._completed: queue.SimpleQueue[Run[Lane]] = queue.SimpleQueue()
        #: numbers the submitted runs: with its start time, a run's place in its pool's take
        #: order (:attr:`Run.order <ax_kombu.worker.run.Run.order>`)
        self._submitted = itertools.count(1)
        #: where ``async def`` processors run (started on first use; the node stops it)
        self.loop = EventLoop()
        #: the start protocol of runs started on the loop (:mod:`~ax_kombu.worker.loopstarts`)
        self._on_loop = LoopStarter(loop=self.loop, resolver=resolver, clock=clock, lease=lease,
                                    stage=stage, start=self._start, take=self._take,
                                    begin=self._begin)
        self._is_async = self._on_loop.is_async
        for executor in executors.values():
            executor.attach_feed(self.loop.feed(executor))

    def submit(self, runs: list[Run[Lane]]) -> None:
        """FENCED → STAGED, handed to their executors: one call per executor for the batch."""
        by_lane: dict[Lane, list[Run[Lane]]] = {}
        for run in runs:
            run.cancel = Cancellation()
            by_lane.setdefault(run.lane, []).append(run)
        self._stage.add(runs)
        # the database clock's epoch on the pool's clock, read once for the batch: runs of one
        # trigger time get one start time, and their submission numbers order them
        epoch_s = time.monotonic() - self._clock() / 1000.0
        starts_on_loop, processor = self._on_loop.start, self._on_loop.processor
        for lane, lane_runs in by_lane.items():
            jobs = []
            for run in lane_runs:
                # its trigger time on the pool's clock: a run received before it waits in the
                # stage, not in a thread; due runs are taken earliest trigger first (a due
                # run keyed "at once" went ahead of every run staged before its trigger time,
                # which then waited for as long as late runs kept coming)
                start_at = epoch_s + run.task.trigger_time / 1000.0
                run.order = (start_at, next(self._submitted))
                func = processor(run.task)  # resolved once: its start calls this one
                if func is not None and self._is_async(func):
                    start, on_loop = partial(starts_on_loop, run, func), True
                else:
                    start, on_loop = partial(self._start, run, func), False
                jobs.append(Submission(start, partial(self._done, run),
                                       partial(self._timeout_s, run.task), run.labels,
                                       run.cancel, start_at, on_loop))
            if not self._executors[lane].submit_reserved(jobs):  # room reserved; stopping
                for run in lane_runs:
                    self._done(run, Outcome(False, abandoned="the pool is closed"))

    def _wait_s(self, task: TaskMessage | RunTask) -> float:
        """How long until the task's trigger time (0 once due), on the database clock."""
        return max(0.0, task.trigger_time - self._clock()) / 1000.0

    def _timeout_s(self, task: TaskMessage | RunTask) -> float:
        """A run's timeout from when a thread takes it: what is left of its wait until its
        trigger time, then ``timeout_ms``."""
        return self._wait_s(task) + task.timeout_ms / 1000.0

    def _start(self, run: Run[Lane], func: Callable[..., Any] | None = None) -> Any:
        """An executor's thread takes a staged run: the checks of the module docstring,
        then its processor, ``func`` as resolved at submit (None: resolved here; raises
        :class:`Withdrawn` if it may not start)."""
        task, cancel = run.task, run.cancel
        assert cancel is not None  # given at submit
        while (left_ms := task.trigger_time - self._clock()) > 0 and not cancel.wait(
                left_ms / 1000.0):
            pass
        while (covered := self._lease.covers(run.incarnation)) is None and not cancel:
            self._lease.wait(run.incarnation, LEASE_WAIT_S)
        with self._stage.lock:
            listed = self._take(run, covered is not False)
        if listed:
            self._release(run)
        return self._begin(run, left_ms, here=False, func=func)

    def _begin(self, run: Run[Lane], left_ms: float, *, here: bool,
               func: Callable[..., Any] | None = None) -> Any:
        """The checks are passed: STARTED, the processor called (or its coroutine handed to
        the loop; ``here``: from the loop's own thread)."""
        task, cancel = run.task, run.cancel
        assert cancel is not None
        if run.state is not State.STARTED:
            raise Withdrawn(f"{cancel.reason or 'withdrawn'} before it started")
        metrics.start_delay.observe(-left_ms / 1000.0)
        assert type(task) is RunTask  # fenced: the row's task
        # the real start (the RUNNING move wrote when it was fenced): the result records it
        task.started_at = max(task.trigger_time, int(self._now_ms()))
        ctx = Context(task_id=task.task_id, attempt=task.attempt, trace_id=task.trace_id,
                      trigger_time=task.trigger_time, task_type=task.task_type,
                      retry_count=task.retry_count, max_retry=task.max_retry,
                      timeout_ms=task.timeout_ms, cancelled=cancel,
                      deadline=time.monotonic() + task.timeout_ms / 1000.0, job=task.job,
                      scheduled_at=task.scheduled_at, shard_index=task.shard_index,
                      shard_total=task.shard_total)
        began, deferred = time.monotonic(), False
        try:
            value = self._execute(run, task, ctx, here, func)
            deferred = type(value) is Deferred
            return value
        finally:
            if not deferred:  # a deferred run is timed when its coroutine ends
                run.lane.timed(time.monotonic() - began)

    @staticmethod
    def _take(run: Run[Lane], covered: bool) -> bool:
        """Under the stage's lock: STARTED if the run may start now; True if it is LISTED
        (released first); else it ends unstarted (or had already: withdrawn)."""
        if run.state not in WAITING:
            return False
        if not covered:  # fenced under an incarnation declared dead: never starts here
            run.move(State.WITHDRAWN)
        elif run.cancel:
            run.move(State.CANCELLED)
        elif run.state is State.LISTED:
            return True
        else:
            run.move(State.STARTED)
        return False

    def _release(self, run: Run[Lane]) -> None:
        """A LISTED run: its release committed first, then STARTED (unless it ended
        meanwhile: withdrawn, cancelled, or its incarnation no longer live)."""
        assert self._listing is not None
        cancel = run.cancel
        released = self._listing.release(run.task.task_id, run.incarnation,
                                         lambda: bool(cancel) or run.state is not State.LISTED)
        with self._stage.lock:
            if run.state is not State.LISTED:
                return
            if cancel:
                run.move(State.CANCELLED)
            elif not released:
                run.move(State.WITHDRAWN)
            else:
                run.move(State.STAGED)
                run.move(State.STARTED)

    def _execute(self, run: Run[Lane], task: RunTask, ctx: Context, here: bool,
                 func: Callable[..., Any] | None = None) -> Any:
        """Call a plain processor inside the run's scopes; an ``async def`` one is a
        :class:`Deferred`: its coroutine runs on the event loop, where the scopes are
        entered (context variables are per asyncio task). ``here``: this is the loop's
        thread, where a plain processor must not run (it is not one unless the registry
        changed since the run was submitted): it goes to a thread. ``func``: the processor
        resolved at submit (None: resolved now, raising why it cannot be)."""
        if type(task.payload) is UnreadablePayload:
            raise ProcessorRefused("the stored payload is not JSON")
        if func is None:
            func = self._resolver.resolve(task.processor, task.callback_url)
        if self._is_async(func):
            body = partial(self._awaited, func, task, ctx, run.lane)
            launch = self.loop.run_here if here else self.loop.run
            return Deferred(partial(launch, body, cancel=ctx.cancelled))
        if here:
            return Deferred(partial(self._on_loop.elsewhere,
                                    partial(self._called, func, task, ctx)))
        return self._called(func, task, ctx)

    def _called(self, func: Callable[..., Any], task: RunTask, ctx: Context) -> Any:
        with entered(self._scopes, task, ctx):
            return call(func, task.payload, ctx)

    async def _awaited(self, func: Callable[..., Any], task: RunTask, ctx: Context,
                       lane: Lane) -> Any:
        """A deferred run's coroutine (the event loop's thread): the processor awaited
        inside the run's scopes, and timed for its lane."""
        began = time.monotonic()
        try:
            with entered(self._scopes, task, ctx):
                return await call_async(func, task.payload, ctx)
        finally:
            lane.timed(time.monotonic() - began)

    def _done(self, run: Run[Lane], outcome: Outcome) -> None:
        """A run's outcome (an executor's thread): STARTED → ENDED, to the result writer;
        it is settled once the outcome is durable. A run that never started ends at once,
        recording nothing."""
        if run.state is not State.STARTED:  # only this call moves a run out of STARTED
            with self._stage.lock:  # its thread may be starting it right now
                if run.state in WAITING:  # given up on before a thread took it
                    run.move(State.ABANDONED)
        if run.state is State.STARTED:
            run.move(State.ENDED)
            task = run.task
            assert type(task) is RunTask  # started, so fenced: the row's task
            self._results.put(task, outcome, on_durable=partial(self._durable, run))
            return
        if self._listing is not None and self._listing.any:
            self._listing.forget([run.task.task_id])  # listed or not: it never starts here
        if run.cancel is not None and run.cancel.reason == "timeout":
            self.expired.put(run)  # nobody else writes its row back
        self._completed.put(run)
        self._wakeup.poke()

    def stop(self) -> None:
        """Stop the event loop (its runs cancelled, each reporting its end) and the threads
        its starts wait on (after the pools: the node's last step)."""
        self.loop.stop()
        self._on_loop.stop()

    def _durable(self, run: Run[Lane]) -> None:
        """ENDED → DURABLE (the result writer's thread): to be settled."""
        run.move(State.DURABLE)
        self._completed.put(run)
        self._wakeup.poke()

    def take_completed(self) -> list[Run[Lane]]:
        """The runs over since the last call (durable, or ended without starting)."""
        return _drain(self._completed)

    def take_expired(self) -> list[Run[Lane]]:
        """The runs whose timeout passed while they waited (see :attr:`expired`), for the
        node to write back."""
        return _drain(self.expired)

    def wake(self, runs: Sequence[Run[Lane]], reason: str = "shutdown") -> None:
        """Set the signal of ``runs`` now (withdrawn ones end without starting): a staged
        run waiting for its trigger time leaves its executor's stage at once."""
        for run in runs:
            if run.cancel is not None:
                run.cancel.set(reason)
        for lane in {r.lane for r in runs}:
            self._executors[lane].release_cancelled()


def _drain(runs: queue.SimpleQueue[Run[Lane]]) -> list[Run[Lane]]:
    """Everything in ``runs`` now, taken out, without waiting."""
    taken: list[Run[Lane]] = []
    while True:
        try:
            taken.append(runs.get_nowait())
        except queue.Empty:
            return taken
