"""A pool's jobs, its threads' waking policy, and its watchdog, which marks jobs overdue at
their deadline and sets their cancellation signal (:mod:`ax_kombu.worker.pools` says what a
timeout means)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ax_kombu.core.outcomes import Outcome
from ax_kombu.worker.executor import Cancellable, Done, Timeout

log = logging.getLogger(__name__)


@dataclass(eq=False, slots=True, kw_only=True)
class Job:
    """A submitted job and where it is (the pool's lock guards it)."""

    fn: Callable[[], Any]
    done: Done
    timeout: Timeout
    #: not taken by a thread before this (the pool's clock)
    start_at: float = 0.0
    started: float = 0.0
    deadline: float | None = None
    labels: Mapping[str, Any] = field(default_factory=dict)
    cancel: Cancellable | None = None
    reported: bool = False
    #: past its deadline, still running; reported as timed out when it returns
    overdue: bool = False


#: threads a pool keeps awake beyond its share of sync jobs (enough to start deferred runs)
SPARE_THREADS = 8
#: weight of the newest job in a pool's share of sync jobs
SYNC_EWMA = 0.05
#: a thread inside one job for longer than this is blocked: the pool wakes another
BLOCKED_S = 0.2


class Awake:
    """How many of a pool's threads wait, run a job or look for one, and how many the pool
    keeps awake (the pool's lock guards it).

    A sync job blocks its thread for the whole run; a deferred one (an ``async def``
    processor) only while it starts. A pool of deferred jobs needs few awake threads to start
    them, and more only take the GIL from the worker's consuming thread, which feeds them.
    So a pool keeps awake :data:`SPARE_THREADS`, plus its measured share of sync jobs times
    its threads (every thread, for a pool of sync jobs), plus the threads its watchdog finds
    inside a job for longer than :data:`BLOCKED_S`: a long or hung sync job never keeps the
    other runs waiting for long.
    """

    __slots__ = ("blocked", "count", "idle", "keeper", "since", "sync_share")

    def __init__(self, count: int) -> None:
        self.count = count
        #: threads waiting for work
        self.idle = 0
        #: one thread waits for the next staged job's start time; the others wait for work
        self.keeper = False
        #: thread → when it took the job it is inside (back for the next: removed)
        self.since: dict[int, float] = {}
        #: threads inside a job for longer than BLOCKED_S, at the watchdog's last look
        self.blocked = 0
        #: moving share of jobs that ran on their thread (not deferred); sync until measured
        self.sync_share = 1.0

    @property
    def awake(self) -> int:
        return self.count - self.idle - self.keeper

    def _wanted(self) -> int:
        return SPARE_THREADS + int(self.sync_share * self.count) + self.blocked

    def took(self, now: float) -> None:
        """The calling thread took a job."""
        self.since[threading.get_ident()] = now

    def back(self, deferred: bool) -> None:
        """The calling thread is back from a job (deferred, or run on it)."""
        self.since.pop(threading.get_ident(), None)
        self.sync_share += ((0.0 if deferred else 1.0) - self.sync_share) * SYNC_EWMA

    def recount(self, now: float) -> int:
        """Count the blocked threads again; returns how many more there are than before."""
        blocked = sum(1 for took in self.since.values() if now - took > BLOCKED_S)
        grown, self.blocked = blocked - self.blocked, blocked
        return max(0, grown)

    def short(self) -> bool:
        """Whether one more thread should be awake."""
        return self.awake < self._wanted()

    def surplus(self) -> bool:
        """Whether a thread looking for a job should wait instead: more are awake than
        wanted, and another awake thread is not inside a job."""
        awake = self.awake
        return awake > self._wanted() and len(self.since) < awake - 1

    def to_wake(self, jobs: int) -> int:
        """How many waiting threads to wake for ``jobs`` new jobs (one at least if none is
        awake)."""
        return min(self.idle, jobs, max(1, self._wanted() - self.awake))


class Watched(Protocol):
    """What the watchdog shares with its pool (:class:`ax_kombu.worker.pools.Pool`): the
    lock, the running jobs and the timeout counts."""

    name: str
    timeouts: int
    _cond: threading.Condition
    _awake: Awake
    _heap: list[Any]
    _closed: bool
    _running: set[Job]
    _overdue: int
    _wake_at: float | None

    def _clock(self) -> float: ...

    def _wake(self, count: int) -> None: ...


class Watchdog:
    """Marks a pool's jobs overdue at their deadline and sets their cancellation signal.

    It shares the pool's lock and state (a part of the pool on its own thread).
    """

    def __init__(self, pool: Watched) -> None:
        self.pool = pool

    def run(self) -> None:
        pool = self.pool
        while True:
            with pool._cond:
                if pool._closed and not pool._running:
                    return
                now = pool._clock()
                expired = self._expired(now)
                if (grown := pool._awake.recount(now)) and pool._heap:
                    pool._wake(grown)  # threads blocked in jobs: others take the rest
                if not expired:
                    pool._cond.wait(self._wait_s())
                    continue
            for job in expired:
                if job.cancel is not None:
                    job.cancel.set("timeout")

    def _expired(self, now: float) -> list[Job]:
        """Jobs that just passed their deadline, marked overdue (the caller has the lock)."""
        pool = self.pool
        expired = [j for j in pool._running
                   if (due := _deadline_ahead(j)) is not None and due <= now]
        for job in expired:
            job.overdue = True
            pool._overdue += 1
            pool.timeouts += 1
            log.warning("job timed out; cancellation signalled, outcome recorded when it returns",
                        extra={"pool": pool.name, **job.labels})
        return expired

    def _wait_s(self) -> float:
        pool = self.pool
        pending = [due for j in pool._running if (due := _deadline_ahead(j)) is not None]
        pool._wake_at = min(pending) if pending else None
        most = BLOCKED_S if pool._awake.since else 1.0  # look for blocked threads
        if pool._wake_at is None:
            return most
        return max(0.0, min(most, pool._wake_at - pool._clock()))


def _deadline_ahead(job: Job) -> float | None:
    """The job's deadline if the watchdog still waits for it (not reported, not overdue)."""
    return None if job.reported or job.overdue else job.deadline


def report(pool: str, job: Job, outcome: Outcome) -> None:
    """Call the job's ``done``; a broken callback must not kill the pool thread."""
    try:
        job.done(outcome)
    except Exception:
        log.exception("outcome callback failed", extra={"pool": pool, **job.labels})
