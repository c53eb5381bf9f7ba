"""The scheduler's heartbeat: its own thread, its own database connection, nothing else.

Contracts:

* **Beats never wait on housekeeping.** Every ``heartbeat_interval_s`` the node's row
  is refreshed, a compare-and-set on its live incarnation
  (:meth:`ax_kombu.scheduler.liveness.Liveness.beat`), through an engine of its own
  (one pooled connection) and on the locally read database clock. No housekeeping step
  (:mod:`ax_kombu.scheduler.housekeeper`) — a lock wait, a statement timeout on a large
  preload, an exception — runs on this thread or uses this connection, so a scheduler
  whose housekeeping fails keeps beating: its peers do not declare it dead and it keeps
  what it holds.
* **A failed beat** (the database unreachable) is logged and counted
  (``ax_housekeeping_errors_total{step="beat"}``); the node stops judging others until
  its beats have landed for a whole silence window again; the next beat comes one
  interval later. Only :class:`~ax_kombu.exceptions.NodeNameInUse` (re-registering
  after being declared dead found the name taken by another live process) ends the
  thread, and the node with it (supervised).
* **Fenced**: a beat that finds the incarnation declared dead has the node drop what it
  holds, waits until the timing loop has dropped it, and registers anew (so what the
  next preload hands over is never dropped with the old wheel).
* **The lease**: each beat that lands confirms the node's
  :class:`~ax_kombu.core.lease.Lease` for the incarnation it beat (or registered)
  from the moment it was sent; the dispatcher publishes a batch only while the lease
  covers the incarnation that claimed it (:mod:`ax_kombu.scheduler.dispatcher`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ax_kombu.core.lease import Lease
from ax_kombu.exceptions import NodeNameInUse
from ax_kombu.observability import metrics
from ax_kombu.scheduler.liveness import Liveness
from ax_kombu.scheduler.loop import Loop

log = logging.getLogger(__name__)


class Heart(Loop):
    """Beats every ``interval_s`` until :meth:`stop`.

    Args:
        liveness: the node's liveness (its :meth:`~Liveness.beat` is called here alone).
        interval_s: ``heartbeat_interval_s``.
        now_ms: database time, read without a round trip (``DbClock.local_ms``).
        lease: confirmed by each beat that lands, for ``incarnation()`` (after the beat).
    """

    def __init__(self, liveness: Liveness, interval_s: float,
                 now_ms: Callable[[], float], lease: Lease | None = None,
                 incarnation: Callable[[], int] = lambda: 0) -> None:
        super().__init__("ax-heartbeat", threading.Event())
        self._liveness = liveness
        self._interval_s = interval_s
        self._now_ms = now_ms
        self._lease = lease
        self._incarnation = incarnation
        #: beats that landed (tests and the info read it)
        self.beats = 0

    def run(self) -> None:
        while not self.stopping:
            started = time.monotonic()
            self.beat()
            self.pause(max(0.0, self._interval_s - (time.monotonic() - started)))

    def beat(self) -> None:
        """One beat; a failure is logged and counted, never raised (but NodeNameInUse)."""
        sent = time.monotonic()
        try:
            self._liveness.beat(int(self._now_ms()))
        except NodeNameInUse:
            raise
        except Exception as exc:  # noqa: BLE001 - nothing but a name clash stops the beats
            self._liveness.database_failed()
            metrics.housekeeping_errors_total.labels("beat").inc()
            log.warning("heartbeat failed; beating again in one interval",
                        extra={"error": str(getattr(exc, "orig", None) or exc)[:500],
                               "retry_in_s": self._interval_s})
            return
        if self._lease is not None:
            self._lease.confirm(sent, self._incarnation())
        self.beats += 1
