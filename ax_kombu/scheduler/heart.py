"""The scheduler's heartbeat: its own thread, its own database connection, nothing else.

Contracts:

* **Beats never wait on housekeeping.** Every ``heartbeat_interval_s`` the node's row
  is refreshed through the node's :class:`~ax_kombu.node.lifecycle.NodeLifecycle` (a
  compare-and-set on its live incarnation), through an engine of its own (one pooled
  connection) and on the locally read database clock. No housekeeping step
  (:mod:`ax_kombu.scheduler.housekeeper`) — a lock wait, a statement timeout on a large
  preload, an exception — runs on this thread or uses this connection, so a scheduler
  whose housekeeping fails keeps beating: its peers do not declare it dead and it keeps
  its tasks.
* **A failed beat** (the database unreachable) is logged and counted by the lifecycle;
  the node stops judging others until its beats have landed for a whole silence window
  again (:meth:`~ax_kombu.scheduler.liveness.Liveness.database_failed`); the next beat
  comes one interval later. Only :class:`~ax_kombu.exceptions.NodeNameInUse`
  (re-registering after being declared dead found the name taken by another live
  process) ends the thread, and the node with it (supervised).
* **Fenced**: a beat that finds the incarnation declared dead revokes the lease, has
  the node drop what it keeps in memory, waits until the timing loop has dropped it,
  and registers anew (so what the next preload hands over is never dropped with the old
  wheel).
* **The lease**: each beat that lands, and each registration, confirms the node's
  :class:`~ax_kombu.core.lease.Lease` for the incarnation it beat (or registered) from
  the moment it was sent; the dispatcher publishes a batch only while the lease covers
  the incarnation that claimed it (:mod:`ax_kombu.scheduler.dispatcher`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from ax_kombu.core.lease import Lease
from ax_kombu.node.lifecycle import NodeLifecycle
from ax_kombu.scheduler.liveness import Liveness
from ax_kombu.scheduler.loop import Loop
from ax_kombu.store.nodes import Heartbeat, TakeOver


class Heart(Loop):
    """Beats every ``interval_s`` until :meth:`stop`.

    Args:
        liveness: the node's liveness (told of every beat that lands, fails or is refused).
        heartbeat: the node's registration (already registered when this starts).
        interval_s: ``heartbeat_interval_s``.
        now_ms: database time, read without a round trip (``DbClock.local_ms``).
        lease: confirmed by each beat that lands and each registration.
        info: what each beat publishes about the node.
    """

    def __init__(self, liveness: Liveness, heartbeat: Heartbeat, interval_s: float,
                 now_ms: Callable[[], float], lease: Lease,
                 info: Callable[[], dict[str, Any]]) -> None:
        super().__init__("ax-heartbeat", threading.Event())
        self._liveness = liveness
        self._interval_s = interval_s
        self._now_ms = now_ms
        self.lifecycle = NodeLifecycle(heartbeat, lease, info, on_refused=liveness.fenced,
                                       on_registered=self._registered,
                                       on_failed=liveness.database_failed)

    @property
    def beats(self) -> int:
        """Beats that landed (tests and the info read it)."""
        return self.lifecycle.beats

    def run(self) -> None:
        while not self.stopping:
            started = time.monotonic()
            self.beat()
            self.pause(max(0.0, self._interval_s - (time.monotonic() - started)))

    def beat(self) -> None:
        """One beat; a failure is logged and counted, never raised (but NodeNameInUse)."""
        if self.lifecycle.beat():
            self._liveness.landed(int(self._now_ms()))

    def _registered(self, _: TakeOver) -> None:
        self._liveness.registered(int(self._now_ms()))
