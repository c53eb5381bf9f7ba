"""The worker's stop: hand unstarted work back to READY, let running tasks finish.

Run once a stop was requested (:class:`~ax_kombu.worker.control.StopFlags`):

* :class:`ConnectedStop` — the step run on the consuming thread while the broker
  connection is still up, so its acks land: the consumers stop
  (:meth:`~ax_kombu.worker.consumer.Consumer.stop_consuming`), then
  :meth:`Shutdown.hand_back`, then :meth:`Shutdown.finish_running` (connected);
* the node's ``runs`` step (:mod:`ax_kombu.worker.node`) finishes the running tasks if the
  connection was lost first: :meth:`Shutdown.finish_running` runs once either way.

1. :meth:`Shutdown.hand_back` — receipt batches in flight are started (or given up: their
   messages stay unacked and the broker gets them back); what was received but not
   started goes DISPATCHING → READY in one statement and its messages are acked
   (HANDED_BACK). If the database cannot be reached they are rejected with requeue
   instead, so the broker redelivers them (RETURNED).
2. :meth:`Shutdown.finish_running` — first the runs that wait in the stage (for a thread,
   or for their trigger time) are withdrawn (their processor is never called) and go
   RUNNING → DELAYED at the same attempt, off the listed runs, with their trigger time and
   retry count unchanged: a scheduler claims them again. If that write fails they stay
   RUNNING on this node and the recovery retries them once the node is gone. Then running
   tasks may end within ``worker_grace_s`` (a cold stop does not wait); the rest are
   reported as abandoned (a failure that may retry; their threads cannot be killed).
   While still connected, ended runs are settled and acked as they end.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from ax_kombu.config import Settings
from ax_kombu.store import Store, transitions
from ax_kombu.store.pinned import PinnedConnection
from ax_kombu.worker.control import TICK_S, StopFlags, Wakeup
from ax_kombu.worker.counters import Counters
from ax_kombu.worker.intake import Intake
from ax_kombu.worker.lanes import Lane
from ax_kombu.worker.run import Run, State

#: at a stop, how long ended runs wait for their outcomes to be durable (and so acked)
DURABLE_WAIT_S = 5.0

log = logging.getLogger(__name__)


class Shutdown:
    """The warm/cold stop steps, on the consuming thread; see the module docstring.

    Args:
        store: where unstarted work is handed back (on a connection pinned for it).
        flags: :attr:`StopFlags.cold` skips waiting for running tasks.
    """

    def __init__(self, settings: Settings, store: Store, intake: Intake, stats: Counters,
                 wakeup: Wakeup, flags: StopFlags) -> None:
        self._grace_s = settings.worker_grace_s
        self._intake = intake
        self._stats = stats
        self._wakeup = wakeup
        self._flags = flags
        self._db = PinnedConnection(store.engine)
        self._node = intake.receipts.node_id
        #: finish_running ran to its end (once: while connected, else at the node's stop)
        self.finished = False

    def hand_back(self) -> None:
        """Start the batches in flight, then hand received-but-unstarted work back to READY."""
        intake = self._intake
        while intake.receipts.in_flight:  # batches in flight start (or are given up) first
            batch = intake.receipts.take(timeout_s=TICK_S)
            if batch is not None:
                intake.planner.receipted(batch)
        unstarted = intake.planner.take_unstarted()
        if not unstarted:
            return
        if not self._release(unstarted):
            for run in unstarted:
                run.move(State.RETURNED)
                run.message.reject(requeue=True)
            return
        for run in unstarted:
            run.move(State.HANDED_BACK)
            run.move(State.SETTLED)
            intake.acks.ack(run)
        intake.acks.flush()
        self._stats.add("handed_back", len(unstarted))
        log.info("unstarted work handed back to READY", extra={"count": len(unstarted)})

    def hand_back_staged(self, withdrawn: list[Run[Lane]], db: Engine | None = None) -> bool:
        """RUNNING → DELAYED (nothing else changed) for runs withdrawn from the stage;
        False if the database failed (the rows stay RUNNING here).

        Args:
            db: where to write from another thread than the consuming one (default the
                connection pinned for the stop).
        """
        if not withdrawn:
            return True
        try:
            with (db or self._db).begin() as conn:
                moved = transitions.hand_back_many(conn, [r.pair for r in withdrawn],
                                                   self._node)
        except SQLAlchemyError:
            log.warning("could not hand staged runs back", exc_info=True,
                        extra={"count": len(withdrawn)})
            return False
        self._stats.add("handed_back", moved)
        log.info("staged runs not started yet handed back", extra={"count": moved})
        return True

    def _release(self, unstarted: list[Run[Lane]]) -> bool:
        """DISPATCHING → READY for ``unstarted``; False if the database failed."""
        try:
            with self._db.begin() as conn:
                transitions.release_many(conn, [r.pair for r in unstarted])
        except SQLAlchemyError:
            log.warning("could not hand work back to READY; returning it to the broker",
                        exc_info=True, extra={"count": len(unstarted)})
            return False
        return True

    def finish_running(self, connected: bool) -> None:
        """Let running tasks end within the grace period (not if cold); abandon the rest.
        Runs once: a second call returns at once.

        Args:
            connected: the broker connection is still up: ended runs are settled
                (and acked) on it. Without it, outcomes are still recorded.
        """
        if self.finished:
            return
        staged = self._intake.withdraw()  # none of them has started, or will
        self.hand_back_staged(staged)
        self._intake.starter.wake(staged)
        lanes = self._intake.lanes
        stop = time.monotonic() + self._grace_s
        while (not self._flags.cold and time.monotonic() < stop
               and any(lane.pool.active for lane in lanes)):
            self._wakeup.clear()
            if connected:
                self._intake.settle()
            self._wakeup.wait(TICK_S * 5)
        abandoned = sum(lane.pool.abandon("worker shut down before the task finished")
                        for lane in lanes)
        if abandoned:
            log.warning("running tasks abandoned at shutdown", extra={"count": abandoned})
        # a message is acked once its outcome is durable: settle until the last outcomes
        # are written (the writer is still running); what is left unacked goes back to
        # the broker, and a redelivery is refused (its task is no longer DISPATCHING)
        stop = time.monotonic() + DURABLE_WAIT_S
        while connected and self._intake.stage.runs and time.monotonic() < stop:
            self._wakeup.clear()
            self._intake.settle()
            self._wakeup.wait(TICK_S)
        if connected:
            self._intake.settle()
        self.finished = True  # at the end: a call cut short by a lost connection is run again

    def close(self) -> None:
        """Release the pinned database connection."""
        self._db.close()


class ConnectedStop:
    """The step of a stop run while the broker connection is still up (module docstring):
    consumers stopped, unstarted work handed back, running tasks finished, acks sent.

    Args:
        stop_consuming: cancels the consumers (or stops the puller and takes what it had).
    """

    name = "stop while connected"

    def __init__(self, shutdown: Shutdown, stop_consuming: Callable[[], None]) -> None:
        self._shutdown = shutdown
        self._stop_consuming = stop_consuming

    def start(self) -> None:
        """Nothing: the consumer starts consuming at each connection."""

    def stop(self) -> None:
        self._stop_consuming()
        self._shutdown.hand_back()
        self._shutdown.finish_running(connected=True)
