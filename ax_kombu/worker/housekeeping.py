"""The worker's periodic jobs besides its heartbeat (a :class:`~ax_kombu.node.steps.Timers`
step of the node): cancellations, expired waits, pool gauges, the listing's scan.

* **Cancellations** (:meth:`Housekeeping.signal_cancelled`, every heartbeat interval): the
  runs whose task was cancelled meanwhile (``ax cancel``) have their signal set: a waiting
  run ends without starting, a running one sees ``ctx.cancelled``. When the worker has
  many runs due within a minute (a burst: thousands, and the check runs every second), one
  read of the cancelled tasks this node fenced in that window
  (:func:`~ax_kombu.store.tasks.cancelled_on`); otherwise its runs' ids
  (:func:`~ax_kombu.store.tasks.cancelled_among`), so a backlog's late runs beside new
  ones never make it read hours of other cancelled tasks (:func:`by_window`).
* **Waits about to end** (:meth:`Housekeeping.watch_waiting`, every :data:`WATCH_S` while
  runs wait for a trigger time): the same for the runs due within :data:`WATCH_AHEAD_MS`
  only, so that ``ax cancel`` up to about that long before a trigger time stops the run
  before it starts (one query for all of them; none while nothing waits).
* **Expired waits** (:meth:`Housekeeping.hand_back_expired`): runs whose timeout passed
  while they waited never started: their rows go back RUNNING → DELAYED at their attempt
  (no retry counted); if the database fails, the next time tries again (or, once this node
  is declared dead, the recovery takes them).
* **Pool gauges**: each lane's slots, those busy, and its unacked messages, in the metrics.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from sqlalchemy import Engine

from ax_kombu.observability import metrics
from ax_kombu.store.clock import DbClock
from ax_kombu.store.tasks import cancelled_among, cancelled_on
from ax_kombu.worker.lanes import Lane
from ax_kombu.worker.run import Run
from ax_kombu.worker.shutdown import Shutdown
from ax_kombu.worker.stage import Stage
from ax_kombu.worker.starts import Starter

log = logging.getLogger(__name__)

#: how often the runs about to reach their trigger time are checked for ``ax cancel``
WATCH_S = 0.05
#: ...those due within this long only: a run waiting longer is checked once it is this close
#: (checking thousands of waiting ids every WATCH_S, with a claim lead of a second, costs a
#: share of the worker's CPU and of the database's before a burst is due)
WATCH_AHEAD_MS = 250


#: the cancel check reads by trigger-time window (not id by id) from this many runs a worker has...
WINDOW_FROM_RUNS = 200
#: ...spread over at most this long: a wider window (a backlog's late runs beside new ones)
#: could hold many cancelled tasks of other workers, which the ids never reach
WINDOW_MAX_MS = 60_000


def by_window(runs: int, lo_ms: int, hi_ms: int) -> bool:
    """Whether the cancel check of ``runs`` runs whose trigger times span ``[lo_ms, hi_ms]``
    reads the window (:func:`~ax_kombu.store.tasks.cancelled_on`: a burst's thousands of
    runs due within seconds) rather than their ids (:func:`~ax_kombu.store.tasks.
    cancelled_among`: few runs, or runs spread over a long time)."""
    return runs >= WINDOW_FROM_RUNS and hi_ms - lo_ms <= WINDOW_MAX_MS


class Housekeeping:
    """The jobs of the module docstring (each called on the node's timer thread)."""

    def __init__(self, *, engine: Engine, clock: DbClock, lanes: Sequence[Lane],
                 stage: Stage, starter: Starter, shutdown: Shutdown, node: str) -> None:
        self._engine = engine
        self._node = node
        self._clock = clock
        self._lanes = lanes
        self._stage = stage
        self._starter = starter
        self._shutdown = shutdown

    def signal_cancelled(self) -> None:
        """Set the signal of every run whose task was cancelled (``ax cancel``)."""
        self._signal(list(self._stage.runs))

    def watch_waiting(self) -> None:
        """The same for the runs waiting for a trigger time at most WATCH_AHEAD_MS away."""
        now = self._clock.local_ms()
        if self._stage.latest_trigger <= now:
            return  # nothing waits for a time (in a burst, thousands wait for a thread)
        self._signal([r for r in list(self._stage.runs)
                      if now < r.task.trigger_time <= now + WATCH_AHEAD_MS])

    def _signal(self, runs: list[Run[Lane]]) -> None:
        """Set the signal of those of ``runs`` whose task was cancelled, read by their
        trigger-time window or by their ids (:func:`by_window`)."""
        by_id = {r.task.task_id: r for r in runs}
        if not by_id:
            return
        times = [r.task.trigger_time for r in by_id.values()]
        lo, hi = min(times), max(times)
        with self._engine.connect() as conn:
            if by_window(len(by_id), lo, hi):
                cancelled = cancelled_on(conn, self._node, lo, hi)
            else:
                cancelled = cancelled_among(conn, list(by_id))
        self._starter.wake([by_id[t] for t in cancelled if t in by_id], "cancelled")

    def hand_back_expired(self) -> None:
        """Write back the runs whose timeout passed while they waited (module docstring)."""
        expired = self._starter.take_expired()
        if expired and not self._shutdown.hand_back_staged(expired, self._engine):
            for run in expired:
                self._starter.expired.put(run)

    def pool_gauges(self) -> None:
        """Each lane's pool in the metrics: its slots, those busy, messages unacked."""
        for lane in self._lanes:
            metrics.pool_size.labels(lane.priority).set(lane.pool.size)
            metrics.pool_busy.labels(lane.priority).set(lane.pool.size - lane.pool.free)
            metrics.pool_prefetched.labels(lane.priority).set(lane.unacked)
