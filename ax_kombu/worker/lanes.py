"""A worker's lane: one queue, its consumer, its bounded pool, and the credit between them.

A lane's slots bound how many of its runs go on at once, sync and ``async def`` together;
its pool has a thread per slot up to ``lane_threads_max``, and slots beyond that serve
``async def`` processors only (they run on the worker's event loop, not on a thread).

Flow control is the broker's own prefetch. A message stays unacked while
its task is staged or runs, and is acked once the run's outcome is known, so
the broker's count of unacked messages on the lane's channel *is* the
lane's occupied capacity, and a prefetch of the lane's :attr:`Lane.window`
means the broker never hands the lane more than it can start or stage.

**The stage.** Beyond its threads a lane takes a bounded number of runs
ahead (:meth:`Lane.stage_target`): fenced RUNNING in large batches before a
thread frees up, they wait in the pool, and a thread that finishes takes the
next with no round trip in between. The stage is at most
:data:`STAGE_PER_THREAD` runs per thread (the design article's bounded queue
per pool) and at most what the lane can finish within ``stage_horizon_s`` at
its measured run time, so a busy worker does not take what an idle one
could start; what does not fit stays in the broker.

Two kinds of runs take a slot without keeping a message, and lower the
prefetch by one each while they do (:meth:`Lane.target`):

* a *stuck* run — timed out and reported, but its thread has not returned
  (threads cannot be killed; see :mod:`ax_kombu.worker.pools`);
* a run whose message was acked early: a task allowed more than
  :data:`ACK_AT_START_MS` (RabbitMQ closes a channel keeping a message
  unacked longer than its ``consumer_timeout``, 30 min by default), or one
  received on a connection since lost.

When the target reaches 0 the consumer is cancelled (a prefetch of 0 would
mean "unlimited") and resumed when a slot frees up. A lane that *pulls*
(Redis, :mod:`ax_kombu.broker.redis_pull`) has no consumer: the worker asks for at
most :meth:`Lane.room` messages, so the same target bounds it. On RabbitMQ the QoS is
set per channel (``global``), the only kind RabbitMQ changes on a live
consumer; every lane has its own channel. Kombu channels are not
thread-safe: only the worker's consuming thread touches a lane's consumer.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from kombu.entity import Queue

from ax_kombu.config import PRIORITIES, Settings
from ax_kombu.exceptions import ConfigurationError
from ax_kombu.worker.pools import Pool
from ax_kombu.worker.processors import split_names
from ax_kombu.worker.run import Run

#: the lane of the worker's own queue (what is sent to it alone), besides the priorities
OWN_LANE = "own"

#: a task allowed longer than this has its message acked when it starts
ACK_AT_START_MS = 10 * 60 * 1000

#: a lane stages at most this many runs per thread
STAGE_PER_THREAD = 200
#: a run's time until runs have been measured: the horizon's default, so a lane that has
#: not timed a run yet stages one run per thread; the first run timed replaces it (an
#: average that only decays from 1 s kept a lane's stage small through its first runs, so
#: a burst due soon after start found almost nothing staged: docs/benchmarks.md, "Issue
#: 21, third session")
FIRST_RUN_S = 1.0
#: what a run costs the worker besides its processor (its share of the RUNNING write,
#: the hand-offs and the result write), added to the measured run time
RUN_OVERHEAD_S = 0.001
#: weight of the newest run in the lane's average run time
RUN_EWMA = 0.05
#: a lane whose prefetch is set by consuming anew (RabbitMQ quorum queues) changes it at
#: most this often: each change is three round trips (cancel, qos, consume)
RECONSUME_INTERVAL_S = 0.1


class Lane:
    """One queue with its pool, consumer, backlog and credit; see the module docstring."""

    def __init__(self, priority: str, queue: Queue, size: int, multiplier: int,
                 on_release: Callable[[], None], stage_horizon_s: float = 0.0, *,
                 threads_max: int | None = None) -> None:
        self.priority = priority
        self.queue = queue
        # slots beyond the threads serve async def processors only (pools.py)
        self.pool = Pool(priority, size, on_release=on_release, threads=threads_max)
        self._unstaged = size * multiplier
        self.stage_horizon_s = stage_horizon_s
        #: the lane's average run time (seconds, moving average of the processors' runs)
        self.run_s = FIRST_RUN_S
        #: runs timed so far (the first one seeds the average)
        self._timed = False
        self.pool.stage_max = self.stage_target()
        self.window = self._unstaged + self.pool.stage_max
        #: slots promised to tasks of receipt batches in flight (not submitted yet)
        self.reserved = 0
        #: received tasks waiting for room in the pool (with a multiplier above 1, or
        #: received before the stage shrank); see backlog_max
        self.backlog: deque[Run[Lane]] = deque()
        self.consumer: Any = None
        #: set when a puller receives this lane's messages (no Kombu consumer):
        #: called with the prefetch, the most it may pop and not have acked
        self.pulled: Callable[[int], None] | None = None
        self.prefetch = 0
        self.consuming = False
        #: RabbitMQ quorum queues: no per-channel prefetch, and a consumer's own is fixed
        #: when it starts consuming, so a new prefetch means consuming anew
        self.reconsume = False
        #: monotonic time before which the prefetch is not changed by consuming anew
        self._reconsume_at = 0.0
        #: messages received on the current connection and not acked yet
        self.unacked = 0
        #: runs whose message was acked (or lost with a connection) while they go on
        self.acked_running = 0

    def backlog_max(self) -> int:
        """How many received tasks may wait unfenced for room: ``pool × (multiplier − 1)``,
        plus the stage (what the broker handed over before the stage shrank waits for the
        next round instead of going back to READY)."""
        return self._unstaged - self.pool.size + self.pool.stage_max

    def free(self) -> int:
        """Runs the pool can take (free slots and stage room) beyond the batches in flight."""
        return max(0, self.pool.room - self.reserved)

    def stage_target(self) -> int:
        """How many runs to stage beyond the threads: what they finish within the horizon
        at the measured run time, at most STAGE_PER_THREAD per thread (0: no horizon)."""
        size = self.pool.size
        if self.stage_horizon_s <= 0:
            return 0
        return max(size, min(size * STAGE_PER_THREAD, self.can_finish(self.stage_horizon_s)))

    @property
    def measured(self) -> bool:
        """Whether a run of the lane has been timed (else run_s is a guess)."""
        return self._timed

    def can_finish(self, horizon_s: float) -> int:
        """How many runs the pool's threads finish within ``horizon_s`` at the measured
        run time."""
        return int(self.pool.size * horizon_s / (self.run_s + RUN_OVERHEAD_S))

    def timed(self, run_s: float) -> None:
        """One run of the lane took ``run_s`` (any thread; a lost update only slows the
        average down)."""
        if not self._timed:
            self._timed = True
            self.run_s = run_s
            return
        self.run_s += (run_s - self.run_s) * RUN_EWMA

    def target(self) -> int:
        """The prefetch this lane should have now (the stage resized to the run time)."""
        self.pool.stage_max = self.stage_target()
        self.window = self._unstaged + self.pool.stage_max
        return self.window - self.pool.stuck - self.acked_running

    def saturated(self) -> bool:
        """True when the broker may not hand this lane anything more now."""
        return not self.consuming or self.unacked >= self.prefetch

    def room(self) -> int:
        """How many more messages the broker may hand this lane now."""
        return max(0, self.prefetch - self.unacked) if self.consuming else 0

    def apply(self, global_qos: bool) -> None:
        """Bring the consumer's prefetch to :meth:`target`, cancelling it at 0."""
        target, consumer = self.target(), self.consumer
        if self.pulled is not None:
            if max(0, target) != self.prefetch or not self.consuming:
                self.prefetch, self.consuming = max(0, target), True
                self.pulled(self.prefetch)
            return
        if consumer is None:
            return
        if target <= 0:
            if self.consuming:
                consumer.cancel()
                self.consuming = False
            return
        if target != self.prefetch:
            if self.reconsume and self.consuming:
                now = time.monotonic()
                if now < self._reconsume_at:
                    return  # the old prefetch a little longer: at most one change per interval
                self._reconsume_at = now + RECONSUME_INTERVAL_S
                consumer.cancel()  # what it received stays unacked on the channel, and is acked
                self.consuming = False
            consumer.qos(prefetch_count=target, apply_global=global_qos and not self.reconsume)
            self.prefetch = target
        if not self.consuming:
            consumer.consume()
            self.consuming = True

    def attach(self, consumer: Any, global_qos: bool,
               pulled: Callable[[int], None] | None = None, *, reconsume: bool = False) -> None:
        """Use ``consumer`` (on a new connection) from now on, or a puller's ``pulled``;
        ``reconsume``: its queue takes no per-channel prefetch (a RabbitMQ quorum queue),
        so a new prefetch is set by consuming anew (see :meth:`apply`)."""
        self.consumer = consumer
        self.pulled = pulled
        self.reconsume = reconsume
        self.consuming = False
        self.prefetch = 0
        self.unacked = 0
        self.apply(global_qos)

    def info(self) -> dict[str, int]:
        return {"size": self.pool.size, "free": self.pool.free, "stuck": self.pool.stuck,
                "overdue": self.pool.overdue,
                "backlog": len(self.backlog) + self.pool.staged, "staged": self.pool.staged,
                "running": self.pool.active - self.pool.staged}


def parse_queues(text: str | Iterable[str], settings: Settings) -> list[str]:
    """``"high,slow"`` (priorities or their queue names) as priorities, in order.

    Raises:
        ConfigurationError: an unknown queue, or none.
    """
    by_name = {settings.queue_for(p): p for p in PRIORITIES} | {p: p for p in PRIORITIES}
    chosen: list[str] = []
    for name in split_names(text):
        if name not in by_name:
            raise ConfigurationError(f"unknown queue {name!r}; use {', '.join(PRIORITIES)}")
        if by_name[name] not in chosen:
            chosen.append(by_name[name])
    if not chosen:
        raise ConfigurationError("no queue to consume (-Q high,default,slow)")
    return chosen
