"""The housekeeper: preload, heartbeat with dead-node recovery, periodic recovery, clock skew.

Each task below runs when due, on the housekeeper's own thread, on the
database clock (every pass re-measures it when due, see
:class:`ax_kombu.store.clock.DbClock`):

* **Preload** — every ``preload_interval_ms`` (50 ms at most on a store
  without wake-ups, SQLite), at once on a producer's wake-up (PostgreSQL
  ``NOTIFY``, :class:`ax_kombu.store.notify.WakeListener`), and again straight
  away while it keeps finding full batches: tasks due within
  ``preload_window_ms`` — CREATED rows and rows nobody holds
  (:func:`ax_kombu.store.recovery.preload`) — are handed to the timing loop;
  a Celery-bound one ``claim_lead_ms`` after its trigger time, so that it fires
  when due and is never staged (:mod:`ax_kombu.store.claims`).
  Memory is bounded by the window and ``max_held``, never by how many future
  tasks exist; no preload starts before the last one is in the wheel.
  A preload that failed may have committed without its reply reaching us:
  the next one also takes back every row the database says this node holds
  (:func:`ax_kombu.store.recovery.held_by`), so none is stranded.
* **Recurring jobs** — every ``job_interval_ms``, before the preload: the
  occurrences due within ``job_lookahead_ms`` are written as tasks
  (:mod:`ax_kombu.scheduler.recurrence`), and the preload that follows takes
  them at once. The first pass of a starting node comes before its first
  preload, so a misfire is settled before anything overdue is fired.
* **Heartbeat** — every ``heartbeat_interval_s``: the node's row is refreshed
  (fenced by incarnation), the clock skew is checked (a skew above
  ``clock_skew_warn_ms`` is logged once per excursion; the gauge always shows
  it), and nodes silent for ``heartbeat_misses`` intervals are claimed dead
  exactly once — but only by a node whose own beats have been landing for a
  whole window (:mod:`ax_kombu.scheduler.liveness`).
* **Recovery** — every ``recovery_interval_s``: unstarted DISPATCHING tasks
  are re-dispatched with a doubling ack timeout (bounded, never to a queue
  without consumer), due tasks held by nobody alive are released, and RUNNING
  tasks of workers not alive are retried or failed. Whatever recovery frees
  triggers a preload at once.

A database error backs the housekeeper off and it tries again; it never ends the node.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from ax_kombu.config import Settings
from ax_kombu.observability import metrics
from ax_kombu.scheduler.liveness import Liveness
from ax_kombu.scheduler.recurrence import Materialiser
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
        on_fenced: called when the node learns it was declared dead.
        jobs: writes recurring jobs' occurrences as tasks.
    """

    def __init__(self, settings: Settings, store: Store, heartbeat: nodes.Heartbeat,
                 timing: TimingLoop, info: Callable[[], dict[str, Any]],
                 on_fenced: Callable[[], None], jobs: Materialiser) -> None:
        super().__init__("ax-housekeeper", threading.Event())
        self._settings = settings
        self._store = store
        self._heartbeat = heartbeat
        self._node_id = heartbeat.node_id
        self._timing = timing
        self._jobs = jobs
        self.liveness = Liveness(settings, store, heartbeat, info, on_fenced, self.wake)
        self._wake_pending = True
        self._reconcile = False  # a preload failed: its rows may be held without our knowing
        self._poll_ms = settings.preload_interval_ms
        self._listener: WakeListener | None = None
        if store.engine.dialect.name == "postgresql":
            self._listener = WakeListener(store.engine, self.wake)
        else:
            self._poll_ms = min(self._poll_ms, POLL_WITHOUT_WAKEUPS_MS)
        self._next = {"jobs": 0, "preload": 0, "beat": 0, "recovery": 0}
        self._skew_warned = False
        self._clock_steps = 0

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
                self.liveness.database_failed()
                self.db_failed("housekeeping", exc)
                continue
            if timeout > 0 and self._wake.wait(timeout):
                self._wake.clear()

    def _housekeeping(self, now: int) -> float:
        """Do what is due; returns how long to sleep (seconds)."""
        timer = self._timing.timer
        metrics.wheel_queue_depth.labels("wheel").set(timer.wheel_depth)
        metrics.wheel_queue_depth.labels("delay").set(timer.delayed_depth)
        if now >= self._next["jobs"]:
            self._materialise(now)
        handing = bool(self._timing.incoming.items)
        preload_due = self._wake_pending or now >= self._next["preload"]
        if preload_due and not handing:  # the last preload is in the wheel: max_held holds
            self._preload(now)
        if now >= self._next["beat"]:
            self._next["beat"] = now + int(self._settings.heartbeat_interval_s * 1000)
            self.liveness.beat(now)
            self._check_skew()
            self._measure_overdue(now)
        if now >= self._next["recovery"]:
            self._next["recovery"] = now + int(self._settings.recovery_interval_s * 1000)
            self.liveness.recover(now)
        if self._wake_pending or self._next["preload"] <= now:
            return 0.001 if self._timing.incoming.items else 0.0
        wake_at = min(self._next.values())
        return max(0.0, min((wake_at - now) / 1000.0, MAX_SLEEP_S))

    def _materialise(self, now: int) -> None:
        """Write the recurring jobs' next occurrences as tasks; preload them at once."""
        self._next["jobs"] = now + self._settings.job_interval_ms  # after an error too
        written, more = self._jobs.run(now)
        if more:
            self._next["jobs"] = now
        if written:
            self._wake_pending = True

    def _preload(self, now: int) -> None:
        """Take the next due tasks into memory (at most ``preload_batch``, up to ``max_held``)."""
        self._wake_pending = False
        settings = self._settings
        room = min(settings.preload_batch, settings.max_held - len(self._timing.timer))
        if room <= 0:
            self._next["preload"] = now + self._poll_ms
            return
        horizon = now + settings.preload_window_ms
        lag = settings.claim_lead_ms  # a Celery-bound task fires when due, not staged
        try:
            with self._store.engine.begin() as conn:
                rows = recovery.preload(conn, self._node_id, now, horizon, room, lag)
                if self._reconcile:  # re-adding an id the wheel has only reschedules it
                    rows += recovery.held_by(conn, self._node_id, horizon, room,
                                             celery_lag_ms=lag)
        except SQLAlchemyError:
            self._wake_pending = True  # try again after the back-off
            self._reconcile = True
            raise
        self._reconcile = False
        self._timing.hand(rows)
        metrics.preload_total.inc(len(rows))
        self._next["preload"] = now if len(rows) == room else now + self._poll_ms

    def _measure_overdue(self, now: int) -> None:
        """``ax_oldest_overdue_seconds`` from the store: it rises even when nothing is
        published (the delay histogram then has no samples)."""
        with self._store.engine.connect() as conn:
            metrics.oldest_overdue.set(recovery.oldest_overdue_ms(conn, now) / 1000.0)

    def _check_skew(self) -> None:
        offset = self._store.clock.offset_ms
        metrics.clock_skew.set(offset / 1000.0)
        steps = self._store.clock.steps
        if steps > self._clock_steps:
            metrics.clock_steps_total.inc(steps - self._clock_steps)
            self._clock_steps = steps
        too_far = abs(offset) > self._settings.clock_skew_warn_ms
        if too_far and not self._skew_warned:
            log.warning("clock differs from the database clock; running on database time",
                        extra={"offset_ms": round(offset, 1)})
        self._skew_warned = too_far
