"""A pool's side of the event loop's feed: the jobs a pool stages for the loop, not for
its threads.

**Runs started on the loop.** A job submitted ``on_loop`` (the start of an ``async def``
processor's run) is staged apart and taken by the feed attached with
:meth:`FeedSource.attach_feed` (the worker's event loop,
:meth:`ax_kombu.worker.eventloop.EventLoop.feed`), not by a thread: its slot is taken the
same way, and its function is called on the loop's thread, where it hands the run's
coroutine to the loop without a hop through a pool thread (and so without waking one).
Without a feed, a thread takes it like any job.

:class:`FeedSource` is a part of :class:`~ax_kombu.worker.pools.Pool` (a base class of
it, as the watchdog of :mod:`ax_kombu.worker.jobs` is a part on its own thread): it shares
the pool's lock, slots and clock, and the pool's own code reads its staged jobs and poke
where a slot frees up or the pool stops.
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Callable, Iterator

from ax_kombu.worker.jobs import Job, Staged


class FeedSource:
    """The ``on_loop`` jobs of a pool and how its feed takes them (the pool's
    :class:`~ax_kombu.worker.executor.Feedable` side). The pool's lock guards them."""

    # the pool's, shared (see the module docstring)
    size: int
    _lock: threading.Lock
    _running: set[Job]
    _seq: Iterator[int]
    _clock: Callable[[], float]
    _take: Callable[[Job, float], Job]

    def __init__(self) -> None:
        #: the staged jobs the feed takes (submitted ``on_loop``), by the time they may
        #: start, then submission order
        self._loop_heap: Staged = []
        #: wakes the feed (any thread; cheap, coalesced): None until one is attached
        self._poke: Callable[[], None] | None = None

    def attach_feed(self, poke: Callable[[], None]) -> None:
        """Jobs submitted ``on_loop`` from now on are taken by the feed ``poke`` wakes
        (:meth:`take_loop`, then ``launch`` on the feed's thread)."""
        self._poke = poke

    def clock(self) -> float:
        return self._clock()

    def take_loop(self) -> tuple[list[Job], float | None]:
        """The feed's thread: the ``on_loop`` jobs due now, as many as slots are free, taken
        (running, their timeouts started); and the start time of the next one waiting
        (None: none waits, or no slot is free — a slot that frees up pokes the feed)."""
        taken: list[Job] = []
        with self._lock:
            heap = self._loop_heap
            if not heap:
                return taken, None
            now = self._clock()
            while heap and heap[0][0] <= now and len(self._running) < self.size:
                taken.append(self._take(heapq.heappop(heap)[2], now))
            nxt = heap[0][0] if heap and len(self._running) < self.size else None
        return taken, nxt

    def _stage_on_loop(self, job: Job) -> None:
        """Add ``job`` to the feed's stage (the caller has the lock, and pokes the feed)."""
        heapq.heappush(self._loop_heap, (job.start_at, next(self._seq), job))

    def _drop_on_loop(self) -> list[Job]:
        """Take every job the feed has not taken, never to start (the caller has the lock)."""
        staged = [job for _, _, job in self._loop_heap]
        self._loop_heap.clear()
        return staged
