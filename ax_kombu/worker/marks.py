"""Start marks: which of a worker's RUNNING tasks may have started.

A worker fences its runs DISPATCHING → RUNNING in batches ahead of its threads
(:mod:`ax_kombu.worker.intake`), so a RUNNING row alone does not say whether its run
started. When the worker dies, a run that started must count a retry (FAILED when none
is left: at-least-once, bounded), and one that was only held in the stage must not: it
gets a new attempt as if it had never been sent.

**Guarantee.** A run's processor is called only once its task id is in the node row's
``start_marks`` (``,id,id,``), committed under the incarnation that fenced the run
(:meth:`StartMarks.ensure`). So a dead worker's RUNNING row whose id is not among its
marks never started (:data:`ax_kombu.store.recovery.UNSTARTED`). A mark is kept until
the run's outcome is durable (:meth:`StartMarks.forget`), so a run that ended is never
taken for one that did not start. An id may stay marked longer (the row then counts as
started: the safe side). A write refused because the incarnation is no longer live
(declared dead, replaced) starts nothing it was asked for.

**Cost.** No write per task: one thread writes the whole set, on its own connection,
whenever marks were asked for since the last write (every write coalesces what came
meanwhile). The intake asks ahead (:meth:`~ax_kombu.worker.intake.Intake.dispatch`): a
run that will start at once is marked in parallel with its RUNNING move, a run held for
its trigger time :data:`MARK_LEAD_S` before it; a run deeper in a busy stage is marked
when a thread reaches it, that thread waiting for one commit, with the next ones of its
lane.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections.abc import Callable, Iterable

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from ax_kombu.store.nodes import Heartbeat

log = logging.getLogger(__name__)

#: a run held for its trigger time is marked this long before it (the write's commit
#: must land before the run is due; a commit now and then takes 100 ms here)
MARK_LEAD_S = 0.3
#: how long a thread waits for a mark before it looks at its run's signal again
WAIT_S = 0.05
#: the first wait after a failed write (doubling to 1 s)
RETRY_S = 0.05
#: marks asked ahead are written at most this often (each write carries the whole set);
#: a thread waiting for its mark is written for at once
MIN_GAP_S = 0.02
#: marks asked for a later moment are grouped on this grid (rounded down: earlier)
GRID_S = 0.05


class StartMarks:
    """This worker's start marks and the thread that writes them.

    Args:
        heartbeat: the node's registration (its ``node_id`` and live ``incarnation``).
        engine: where the marks are written (an engine of their own: a result batch or a
            receipt never holds a mark up).
        clock: monotonic seconds.
    """

    def __init__(self, heartbeat: Heartbeat, engine: Engine,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._heartbeat = heartbeat
        self._engine = engine
        self._clock = clock
        self._cond = threading.Condition()
        #: ids to be in the row at the next write
        self._marks: set[int] = set()
        #: the ids of the last committed write, and the incarnation it was written under
        self.durable: frozenset[int] = frozenset()
        self.incarnation = 0
        #: the incarnation a write was refused for (that incarnation starts nothing more)
        self._refused = -1
        #: (mark at, task id): marks asked for a later moment
        self._timed: list[tuple[float, int]] = []
        self._dirty = False
        #: pool threads waiting in ensure()
        self._waiters = 0
        self._last_write = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.writes = 0

    # -- asked by the intake and the pool threads -------------------------------------------

    def ask(self, ids: Iterable[int], at: float = 0.0) -> None:
        """Mark ``ids`` at the next write, or once the monotonic clock reaches ``at``."""
        with self._cond:
            if at > self._clock():
                at -= at % GRID_S
                for task_id in ids:
                    heapq.heappush(self._timed, (at, task_id))
            else:
                self._marks.update(ids)
                self._dirty = True
            self._cond.notify_all()

    def ensure(self, task_id: int, incarnation: int, gone: Callable[[], bool]) -> bool:
        """Wait until ``task_id`` is durably marked under ``incarnation``: True; False if
        the incarnation is no longer live or ``gone()`` (the run was withdrawn or
        cancelled meanwhile). Called by a pool thread before it calls the processor."""
        if self.incarnation == incarnation and task_id in self.durable:
            return True
        with self._cond:
            if task_id not in self._marks:
                self._marks.add(task_id)
                self._dirty = True
                self._cond.notify_all()
            self._waiters += 1
            self._cond.notify_all()
            try:
                while not (self.incarnation == incarnation and task_id in self.durable):
                    if self._refused >= incarnation or self.incarnation > incarnation or gone():
                        return False
                    self._cond.wait(WAIT_S)
            finally:
                self._waiters -= 1
            return True

    def forget(self, task_id: int) -> None:
        """The run ended and its outcome, if any, is durable (or it never started): its mark
        goes at the next write."""
        with self._cond:
            self._marks.discard(task_id)

    # -- the writer ------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ax-start-marks", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(5.0)

    def _run(self) -> None:
        delay_s = RETRY_S
        while not self._stop.is_set():
            with self._cond:
                while not self._stop.is_set() and not self._due():
                    self._cond.wait(self._wait_s())
                while (not self._stop.is_set() and not self._waiters
                       and (gap := self._last_write + MIN_GAP_S - self._clock()) > 0):
                    self._cond.wait(gap)
                if self._stop.is_set():
                    return
                self._due()
                self._dirty = False
                marks = frozenset(self._marks)
            incarnation = self._heartbeat.incarnation
            try:
                with self._engine.begin() as conn:
                    live = self._heartbeat.write_start_marks(conn, incarnation, _encode(marks))
            except SQLAlchemyError:
                log.warning("start marks not written; runs not marked yet wait",
                            exc_info=True, extra={"node": self._heartbeat.node_id})
                with self._cond:
                    self._dirty = True
                self._stop.wait(delay_s)
                delay_s = min(1.0, delay_s * 2)
                continue
            delay_s = RETRY_S
            self._last_write = self._clock()
            self.writes += 1
            with self._cond:
                if live:
                    self.durable, self.incarnation = marks, incarnation
                else:
                    self._refused = max(self._refused, incarnation)
                self._cond.notify_all()

    def _due(self) -> bool:
        """Move the timed marks whose moment has come; True when a write is owed (marks
        asked for, or the node registered anew since the last write)."""
        now = self._clock()
        while self._timed and self._timed[0][0] <= now:
            self._marks.add(heapq.heappop(self._timed)[1])
            self._dirty = True
        registered = self._heartbeat.incarnation
        return self._dirty or (registered not in (0, self.incarnation)
                               and registered > self._refused)

    def _wait_s(self) -> float:
        if self._timed:
            return max(0.0, min(1.0, self._timed[0][0] - self._clock()))
        return 1.0


def _encode(ids: Iterable[int]) -> str:
    """``,1,2,3,``: each id between commas, so ``LIKE '%,id,%'`` finds exactly it."""
    return "," + "".join(f"{task_id}," for task_id in ids)
