"""The housekeeper: preload, heartbeat with dead-node recovery, periodic recovery, clock skew.

Each task below runs when due, on the housekeeper's own thread, on the
database clock (every pass re-measures it when due, see
:class:`ax_kombu.store.clock.DbClock`):

* **Preload** — every ``preload_interval_ms`` (50 ms at most on a store
  without wake-ups, SQLite), at once on a producer's wake-up (PostgreSQL
  ``NOTIFY``, :class:`ax_kombu.store.notify.WakeListener`), and again straight
  away while it keeps finding full batches: tasks due within
  ``preload_window_ms`` — CREATED rows and rows nobody holds
  (:func:`ax_kombu.store.recovery.preload`) — are handed to the timing loop.
  Memory is bounded by the window and ``max_held``, never by how many future
  tasks exist; no preload starts before the last one is in the wheel.
* **Heartbeat** — every ``heartbeat_interval_s``: the node's row is refreshed,
  the clock skew is checked (a skew above ``clock_skew_warn_ms`` is logged once
  per excursion; the gauge always shows it), and nodes silent for
  ``heartbeat_misses`` intervals are claimed dead exactly once (a
  compare-and-set): their held tasks are released for adoption and a dead
  worker's RUNNING tasks are retried or failed.
* **Recovery** — every ``recovery_interval_s``: DISPATCHING tasks older than
  ``ack_timeout_ms`` go back to READY, due tasks held by nobody alive are
  released, and RUNNING tasks of workers not alive are retried or failed.
  Whatever recovery frees triggers a preload at once.

A database error backs the housekeeper off and it tries again; it never ends the node.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from ax_kombu.config import Settings
from ax_kombu.observability import metrics
from ax_kombu.scheduler.stage import MAX_SLEEP_S, Stage
from ax_kombu.scheduler.timing import TimingLoop
from ax_kombu.store import Store, nodes, recovery
from ax_kombu.store.notify import WakeListener

log = logging.getLogger(__name__)

#: how often a store without wake-ups (SQLite) is polled for new tasks
POLL_WITHOUT_WAKEUPS_MS = 50


class Housekeeper(Stage):
    """Preloads, heartbeats and recovers, each when due, until :meth:`stop`.

    Args:
        settings: the node's settings.
        store: the task store.
        heartbeat: the node's registration (already registered when this starts).
        timing: where preloaded ids are handed; its wheel's size bounds the preload.
        info: what the heartbeat publishes about the node.
    """

    def __init__(self, settings: Settings, store: Store, heartbeat: nodes.Heartbeat,
                 timing: TimingLoop, info: Callable[[], dict[str, Any]]) -> None:
        super().__init__("ax-housekeeper", threading.Event())
        self._settings = settings
        self._store = store
        self._heartbeat = heartbeat
        self._node_id = heartbeat.node_id
        self._timing = timing
        self._info = info
        self._wake_pending = True
        self._poll_ms = settings.preload_interval_ms
        self._listener: WakeListener | None = None
        if store.engine.dialect.name == "postgresql":
            self._listener = WakeListener(store.engine, self.wake)
        else:
            self._poll_ms = min(self._poll_ms, POLL_WITHOUT_WAKEUPS_MS)
        now = int(time.time() * 1000)
        self._next = {"preload": 0, "beat": 0, "recovery": now + self._recovery_ms()}
        self._skew_warned = False

    # -- control -------------------------------------------------------------------------

    def wake(self) -> None:
        """Preload now (a producer wrote a task due soon, or recovery freed some)."""
        self._wake_pending = True
        self._wake.set()

    def start(self) -> None:
        """Start the thread, then the wake-up listener (PostgreSQL)."""
        super().start()
        if self._listener is not None:
            self._listener.start()

    def stop(self) -> None:
        """Stop the listener and ask the thread to end; :meth:`join` waits for a preload
        in progress to land in the wheel."""
        if self._listener is not None:
            self._listener.stop()
        super().stop()

    # -- the loop ------------------------------------------------------------------------

    def run(self) -> None:
        while not self.stopping:
            try:
                timeout = self._housekeeping(self._store.now_ms())  # re-measures the clock
            except SQLAlchemyError as exc:
                self.db_failed("housekeeping", exc)
                continue
            if timeout > 0 and self._wake.wait(timeout):
                self._wake.clear()

    def _housekeeping(self, now: int) -> float:
        """Do what is due; returns how long to sleep (seconds)."""
        timer = self._timing.timer
        metrics.wheel_queue_depth.labels("wheel").set(timer.wheel_depth)
        metrics.wheel_queue_depth.labels("delay").set(timer.delayed_depth)
        handing = bool(self._timing.incoming.items)
        preload_due = self._wake_pending or now >= self._next["preload"]
        if preload_due and not handing:  # the last preload is in the wheel: max_held holds
            self._preload(now)
        if now >= self._next["beat"]:
            self._beat(now)
        if now >= self._next["recovery"]:
            self._recover(now)
        if self._wake_pending or self._next["preload"] <= now:
            return 0.001 if self._timing.incoming.items else 0.0
        wake_at = min(self._next.values())
        return max(0.0, min((wake_at - now) / 1000.0, MAX_SLEEP_S))

    def _preload(self, now: int) -> None:
        """Take the next due tasks into memory (at most ``preload_batch``, up to ``max_held``)."""
        self._wake_pending = False
        settings = self._settings
        room = min(settings.preload_batch, settings.max_held - len(self._timing.timer))
        if room <= 0:
            self._next["preload"] = now + self._poll_ms
            return
        try:
            with self._store.engine.begin() as conn:
                rows = recovery.preload(conn, self._node_id, now,
                                        now + settings.preload_window_ms, room)
        except SQLAlchemyError:
            self._wake_pending = True  # try again after the back-off
            raise
        self._timing.hand(rows)
        metrics.preload_total.inc(len(rows))
        self._next["preload"] = now if len(rows) == room else now + self._poll_ms

    def _beat(self, now: int) -> None:
        """Heartbeat, check the skew, and recover the tasks of nodes that went silent."""
        self._next["beat"] = now + int(self._settings.heartbeat_interval_s * 1000)
        self._heartbeat.beat(self._info())
        self._check_skew()
        with self._store.engine.begin() as conn:
            dead = nodes.claim_dead(conn, self._silence_ms())
            released = recovery.release_held(conn, dead)
            recovered = recovery.recover_running(conn, dead, now)
        if dead:
            log.warning("nodes stopped heartbeating; recovering their tasks",
                        extra={"nodes": dead, "released": released, "running": len(recovered)})
            metrics.recovered_total.labels("held").inc(released)
            metrics.recovered_total.labels("running").inc(len(recovered))
            self.wake()

    def _recover(self, now: int) -> None:
        """The slow scan: unacked dispatches, orphaned held tasks, orphaned running tasks."""
        self._next["recovery"] = now + self._recovery_ms()
        silent_since = now - self._silence_ms()
        with self._store.engine.begin() as conn:
            unacked = recovery.requeue_unacked(conn, now - self._settings.ack_timeout_ms)
            orphans = recovery.release_orphans(conn, silent_since, silent_since)
            running = recovery.recover_orphan_running(conn, now, silent_since)
        if unacked or orphans or running:
            log.warning("recovery found tasks to dispatch again",
                        extra={"ack_timeouts": len(unacked), "orphans": orphans,
                               "running": len(running)})
            metrics.ack_timeout_total.inc(len(unacked))
            metrics.recovered_total.labels("orphan").inc(orphans)
            metrics.recovered_total.labels("running").inc(len(running))
            self.wake()

    def _check_skew(self) -> None:
        offset = self._store.clock.offset_ms
        metrics.clock_skew.set(offset / 1000.0)
        too_far = abs(offset) > self._settings.clock_skew_warn_ms
        if too_far and not self._skew_warned:
            log.warning("clock differs from the database clock; running on database time",
                        extra={"offset_ms": round(offset, 1)})
        self._skew_warned = too_far

    def _recovery_ms(self) -> int:
        return int(self._settings.recovery_interval_s * 1000)

    def _silence_ms(self) -> int:
        s = self._settings
        return int(s.heartbeat_interval_s * 1000 * s.heartbeat_misses)
