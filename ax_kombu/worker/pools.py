"""Bounded, isolated execution pools: one per queue, a fixed number of threads each.

Guarantees:

* **Bounded.** A pool of size N runs at most N jobs, and *stages* at most
  :attr:`Pool.stage_max` more: jobs accepted ahead of a free thread, which a
  thread that finishes takes next with no I/O in between (the worker fences
  them RUNNING in batches before threads free up). :meth:`Pool.try_submit`
  returns False when both are full, and the caller decides what to do with the
  work (the worker hands it back to the database). Nothing grows past
  ``size + stage_max``.
* **Isolated.** Pools share nothing but the GIL: a pool full of slow jobs
  does not delay a job submitted to another pool.
* **One outcome per job.** Each job's ``done`` callback is called exactly
  once: with its result, or with a timeout, or with an "abandoned" outcome
  when the pool is given up on at shutdown — whichever comes first.
* **Timeouts never make a job run twice at once.** A Python thread cannot be
  killed. When a job overruns its timeout, the watchdog sets the job's
  cancellation signal (``ctx.cancelled``, reason ``"timeout"``) and counts it
  *overdue*, but reports nothing yet (a staged job's timeout starts when a
  thread takes it): the job's outcome — timed out, whatever
  it returns — is reported only when its thread really returns, so its task
  cannot be retried while it still runs. Its slot stays occupied meanwhile
  (:attr:`Pool.overdue` in the worker's heartbeat and ``ax status``). A job
  that never returns keeps its slot and its task RUNNING for the life of the
  process; a warm shutdown gives up on it after the grace period.
* **Abandoned jobs.** At shutdown the pool may be given up on
  (:meth:`Pool.abandon`): every unreported job is reported abandoned at
  once and its cancellation signal set; its thread keeps its slot
  (:attr:`Pool.stuck`) until it returns or the process exits.
* **Deferred runs.** A job whose function returns a :class:`~ax_kombu.worker.executor.Deferred`
  (an ``async def`` processor, on the worker's event loop) keeps its slot, running for the
  watchdog and :meth:`Pool.abandon`, until it reports its end (its signal cancels it); its
  thread takes the next job at once, so a pool may have fewer threads than slots.
* **Runs started on the loop.** A job submitted ``on_loop`` is taken by the worker's event
  loop, not by a thread, under the same slots: :mod:`ax_kombu.worker.feed`.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

from ax_kombu.core.outcomes import Outcome as Outcome  # noqa: PLC0414 - re-exported
from ax_kombu.worker.executor import Cancellable, Deferred, Done, Submission, Timeout
from ax_kombu.worker.feed import FeedSource
from ax_kombu.worker.jobs import Job, Staged, Watchdog, cancelled_first, report

log = logging.getLogger(__name__)

Clock = Callable[[], float]


class Pool(FeedSource):
    """A fixed set of threads running at most ``size`` jobs at a time: an
    :class:`~ax_kombu.worker.executor.Executor` (its feed's side: :class:`FeedSource`).

    Args:
        name: for thread names and logs ("high", "default", "slow").
        size: the number of slots: jobs running at once, sync and deferred together.
        threads: the number of threads (None: one per slot; at most ``size``). A thread
            runs a sync job to its end but only starts a deferred one, so slots beyond
            the threads serve deferred runs (``async def`` processors) only.
        clock: monotonic seconds (injected for tests).
        on_release: called (from the pool thread) when a slot frees up without an
            outcome being reported: a timed-out or abandoned job's thread returned.
            (A reported outcome goes to the job's ``done``, which wakes its caller.)
    """

    def __init__(self, name: str, size: int, *, clock: Clock = time.monotonic,
                 on_release: Callable[[], None] | None = None,
                 threads: int | None = None) -> None:
        if size < 1:
            raise ValueError(f"pool {name!r} needs at least one slot, got {size}")
        if threads is not None and threads < 1:
            raise ValueError(f"pool {name!r} needs at least one thread, got {threads}")
        super().__init__()
        self.name = name
        self.size = size
        self._clock = clock
        self._on_release = on_release
        #: guards the accounting; the hot path takes it directly, waits use _cond
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        #: the staged jobs (accepted, waiting for a thread; see stage_max) by the time they
        #: may start, then submission order: a thread takes the head once it is due, so a
        #: job waiting for its start time takes no thread
        self._heap: Staged = []
        self._seq = itertools.count()
        self._work = threading.Condition(self._lock)
        self._running: set[Job] = set()
        #: how many jobs may wait for a thread beyond the slots (the worker sets it)
        self.stage_max = 0
        self._stuck = 0
        self._overdue = 0
        self._reporting = 0  # jobs out of _running whose outcome is being reported (active)
        self._joiners = 0  # threads waiting in join()
        self._wake_at: float | None = None
        self._closed = False
        self.timeouts = 0
        self.late_returns = 0
        self._idle = 0  # threads waiting in _next
        count = size if threads is None else min(size, threads)
        self._threads = [threading.Thread(target=self._serve, name=f"ax-{name}-{i}", daemon=True)
                         for i in range(count)]
        for thread in self._threads:
            thread.start()
        self._watchdog = threading.Thread(target=Watchdog(self).run,
                                          name=f"ax-{name}-watchdog", daemon=True)
        self._watchdog.start()

    # -- accounting -----------------------------------------------------------------------

    @property
    def busy(self) -> int:
        """Jobs taken: running (including timed-out threads that keep a slot) and staged."""
        return len(self._running) + len(self._heap) + len(self._loop_heap)

    @property
    def free(self) -> int:
        """Threads no running or staged job has taken."""
        return 0 if self._closed else max(0, self.size - self.busy)

    @property
    def room(self) -> int:
        """How many more jobs :meth:`try_submit` accepts now (free slots and stage room)."""
        if self._closed:
            return 0
        return max(0, self.size + self.stage_max - self.busy)

    @property
    def staged(self) -> int:
        """Jobs accepted and waiting for a thread (or the feed)."""
        return len(self._heap) + len(self._loop_heap)

    def running_for_s(self) -> float:
        """How long the shortest run in progress has been running (0: a thread is free or
        none runs)."""
        if self.free:
            return 0.0
        with self._lock:
            started = max((job.started for job in self._running), default=None)
        return 0.0 if started is None else self._clock() - started

    @property
    def stuck(self) -> int:
        """Slots kept by jobs already reported (timed out or abandoned) that still run."""
        return self._stuck

    @property
    def overdue(self) -> int:
        """Jobs past their timeout whose thread has not returned (outcome not reported yet)."""
        return self._overdue

    @property
    def active(self) -> int:
        """Running or staged jobs whose outcome has not been reported yet."""
        return self.busy - self._stuck + self._reporting

    # -- submitting -----------------------------------------------------------------------

    def try_submit(self, fn: Callable[[], Any], done: Done, *, timeout_s: Timeout = None,
                   labels: Mapping[str, Any] | None = None,
                   cancel: Cancellable | None = None, reserved: bool = False,
                   start_at: float = 0.0) -> bool:
        """Run ``fn`` in a free thread, or stage it for the next one that frees up; False
        (and nothing done) when the slots and the stage are full.

        Args:
            done: called once with the :class:`Outcome`, from a pool thread.
            timeout_s: after this long (from when a thread takes the job; a function is
                called then) the job is overdue: ``cancel`` is set, and its outcome
                will be "timed out" whenever its thread returns.
            labels: structured log fields for this job (task_id, trace_id).
            cancel: the job's cancellation signal.
            reserved: the caller counted the job's room in :attr:`room` before (the
                stage may have shrunk since): it is staged even beyond ``stage_max``.
            start_at: no thread takes the job before this time (the pool's clock); staged
                jobs are taken in this order, a job that waits taking no thread.
        """
        job = Job(fn=fn, done=done, timeout=timeout_s, start_at=start_at, labels=labels or {},
                  cancel=cancel)
        with self._lock:
            taken = self.busy
            if self._closed or (taken >= self.size + self.stage_max and not reserved):
                return False
            self._stage(job)
            self._wake(1)
        return True

    def submit_reserved(self, jobs: Sequence[Submission]) -> bool:
        """Stage ``jobs`` whose room the caller reserved (``try_submit``'s ``reserved``), under
        one lock, waking as many idle threads as there are jobs; False, and none staged,
        once the pool is closed. (A receipt batch starts hundreds of runs at once: one
        lock and one wake-up for them all, not one each, while the threads take work.)"""
        made = [Job(fn=j.fn, done=j.done, timeout=j.timeout_s, start_at=j.start_at,
                    labels=j.labels, cancel=j.cancel) for j in jobs]
        poke = self._poke
        looped = 0
        with self._lock:
            if self._closed:
                return False
            for job, submitted in zip(made, jobs, strict=True):
                if submitted.on_loop and poke is not None:
                    self._stage_on_loop(job)
                    looped += 1
                else:
                    self._stage(job)
            if looped < len(made):
                self._wake(len(made) - looped)
        if looped and poke is not None:
            poke()
        return True

    def launch(self, job: Job) -> None:
        """Call a taken job's function and report what it returned or raised; a
        :class:`Deferred` keeps the slot until its run ends (:meth:`_defer`). A pool thread
        calls it for each job it takes, the feed's thread for each :meth:`take_loop` took."""
        try:
            value = job.fn()
        except BaseException as exc:  # noqa: BLE001 - any error is the job's outcome
            self._ended(job, None, exc)
            return
        if type(value) is Deferred:
            self._defer(job, value)
        else:
            self._finish(job, Outcome(True, value=value, duration_s=self._clock() - job.started))

    def _stage(self, job: Job) -> None:
        """Add ``job`` to the stage (the caller has the lock; the caller wakes a thread, which
        looks at the head again)."""
        heapq.heappush(self._heap, (job.start_at, next(self._seq), job))

    def release_cancelled(self) -> None:
        """Staged jobs whose cancellation signal is set are taken now, not at their start
        time (their run ends at once without starting: the caller's ``fn`` sees the
        signal), so their slots free up."""
        with self._lock:
            looped = cancelled_first(self._loop_heap)
            if cancelled_first(self._heap):
                self._work.notify_all()
        if looped and self._poke is not None:
            self._poke()

    def _next(self) -> Job | None:
        """Take the next staged job once it may start and a slot is free (a pool thread);
        None once closed and empty. Popped and taken under one lock: a job is staged (in
        the heap) or running, never between, so :meth:`abandon` finds every job. A thread
        with nothing to take waits until the head's start time or until woken (a job
        staged, a slot freed, the pool closed)."""
        with self._work:
            while True:
                wait: float | None = None
                if self._heap and len(self._running) < self.size:
                    now = self._clock()
                    wait = self._heap[0][0] - now
                    if wait <= 0:
                        return self._take(heapq.heappop(self._heap)[2], now)
                elif self._closed and not self._heap:
                    return None
                self._idle += 1
                try:
                    self._work.wait(wait)
                finally:
                    self._idle -= 1

    def _wake(self, count: int) -> None:
        """Wake up to ``count`` waiting threads (the caller has the lock)."""
        if self._idle and count > 0:
            self._work.notify(min(self._idle, count))

    def _take(self, job: Job, now: float) -> Job:
        """A thread (or the feed) takes a staged job: its clock and deadline start now (the
        caller has the lock; a job's timeout function is called here, and must not block)."""
        timeout = job.timeout() if callable(job.timeout) else job.timeout
        job.started = now
        job.deadline = None if timeout is None else now + timeout
        self._running.add(job)
        if job.deadline is not None and (self._wake_at is None or job.deadline < self._wake_at):
            self._cond.notify_all()  # the watchdog must wake earlier than it planned
        return job

    # -- running --------------------------------------------------------------------------

    def _serve(self) -> None:
        while (job := self._next()) is not None:
            self.launch(job)

    def _defer(self, job: Job, deferred: Deferred) -> None:
        """The job's run goes on elsewhere: its slot stays taken (the job stays running)
        until the run reports its end, and this thread takes the next job."""
        try:
            deferred.launch(partial(self._ended, job))
        except BaseException as exc:  # noqa: BLE001 - a launch that fails ends the run
            self._ended(job, None, exc)

    def _ended(self, job: Job, value: Any, error: BaseException | None) -> None:
        """A run's end (a pool thread, or the event loop's for a deferred run)."""
        duration_s = self._clock() - job.started
        self._finish(job, Outcome(True, value=value, duration_s=duration_s) if error is None
                     else Outcome(False, error=error, duration_s=duration_s))

    def _finish(self, job: Job, outcome: Outcome) -> None:
        """The slot is free before the outcome is reported: whoever the report wakes
        (the worker acks, and is handed the next message) finds the slot free."""
        with self._lock:
            first = not job.reported
            job.reported = True
            full = len(self._running) >= self.size
            self._running.discard(job)
            if full and self._heap:
                # a thread may wait for this slot, not for a start time: only a deferred
                # run holds a slot without a thread, so in a lane of sync runs a finished
                # run wakes no other thread (idle ones already wait for the head's start)
                self._wake(1)
            poke = self._poke if self._loop_heap else None
            if first:
                self._reporting += 1
                if job.overdue:
                    self._overdue -= 1
                    self.late_returns += 1
            else:
                self._stuck -= 1
                self.late_returns += 1
        if poke is not None:
            poke()  # a slot freed: the feed may take a staged job
        if first and job.overdue:
            log.warning("a timed-out job returned; recording it as timed out",
                        extra={"pool": self.name, "ran_s": round(outcome.duration_s, 3),
                               **job.labels})
            outcome = Outcome(False, error=outcome.error, timed_out=True,
                              duration_s=outcome.duration_s)
        if first:
            try:
                report(self.name, job, outcome)
            finally:
                with self._lock:
                    self._reporting -= 1
                    if self._joiners:
                        self._cond.notify_all()
            return
        log.warning("an abandoned job returned; its slot is free again",
                    extra={"pool": self.name, "ran_s": round(outcome.duration_s, 3),
                           **job.labels})
        if self._on_release is not None:
            self._on_release()

    # -- stopping -------------------------------------------------------------------------

    def join(self, timeout_s: float) -> bool:
        """Wait until no job is :attr:`active`; False if some still are after ``timeout_s``."""
        with self._cond:
            self._joiners += 1
            try:
                return self._cond.wait_for(lambda: not self.active, timeout_s)
            finally:
                self._joiners -= 1

    def abandon(self, reason: str) -> int:
        """Report every active job as abandoned now; returns how many.

        Their threads keep running (and keep their slots) until they return; staged
        jobs are never started.
        """
        with self._cond:
            jobs = [j for j in self._running if not j.reported]
            for job in jobs:
                job.reported = True
                self._stuck += 1
                if job.overdue:
                    self._overdue -= 1
            # never started: no thread (nor the feed) takes one
            staged = [job for _, _, job in self._heap] + self._drop_on_loop()
            for job in staged:
                job.reported = True
            self._heap.clear()
            jobs += staged
            if jobs and self._joiners:
                self._cond.notify_all()  # no longer active: join() may return
        for job in jobs:
            if job.cancel is not None:
                job.cancel.set("shutdown")
            ran_s = self._clock() - job.started if job.started else 0.0
            report(self.name, job, Outcome(False, abandoned=reason, duration_s=ran_s))
        return len(jobs)

    def close(self) -> None:
        """Refuse new jobs and let idle threads exit (running ones finish first)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
            self._work.notify_all()
