"""A pool's jobs and its watchdog, which marks them overdue at their deadline and sets their
cancellation signal (:mod:`ax_kombu.worker.pools` says what a timeout means)."""

from __future__ import annotations

import heapq
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


#: staged jobs by the time they may start, then submission order: (start_at, seq, job)
Staged = list[tuple[float, int, Job]]


def cancelled_first(heap: Staged) -> bool:
    """Key the staged jobs whose signal is set to start now, in place (the caller has the
    pool's lock); True if there were any: they are taken now, and their run ends at once
    without starting."""
    if not any(job.cancel for _, _, job in heap):
        return False
    heap[:] = [(0.0 if job.cancel else at, seq, job) for at, seq, job in heap]
    heapq.heapify(heap)
    return True


class Watched(Protocol):
    """What the watchdog shares with its pool (:class:`ax_kombu.worker.pools.Pool`): the
    lock, the running jobs and the timeout counts."""

    name: str
    timeouts: int
    _cond: threading.Condition
    _closed: bool
    _running: set[Job]
    _overdue: int
    _wake_at: float | None

    def _clock(self) -> float: ...


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
                expired = self._expired(pool._clock())
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
        if pool._wake_at is None:
            return 1.0
        return max(0.0, min(1.0, pool._wake_at - pool._clock()))


def _deadline_ahead(job: Job) -> float | None:
    """The job's deadline if the watchdog still waits for it (not reported, not overdue)."""
    return None if job.reported or job.overdue else job.deadline


def report(pool: str, job: Job, outcome: Outcome) -> None:
    """Call the job's ``done``; a broken callback must not kill the pool thread."""
    try:
        job.done(outcome)
    except Exception:
        log.exception("outcome callback failed", extra={"pool": pool, **job.labels})
