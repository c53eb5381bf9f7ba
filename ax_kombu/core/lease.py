"""A node's lease on its incarnation: how long it may still act on shared state.

Every daemon keeps one (through :class:`ax_kombu.node.lifecycle.NodeLifecycle`). A heartbeat is a compare-and-set on the node's live
incarnation, and no peer declares a node dead before its last heartbeat is
``silence`` old on the database clock, so a beat that succeeded proves the
incarnation live for that long after it was sent. A worker starts a staged run,
and a scheduler publishes a claim, only while its lease covers the incarnation
that fenced the work (:mod:`ax_kombu.worker.starts`, :mod:`ax_kombu.scheduler.dispatcher`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Lease:
    """How long this node may still act under its incarnation (a worker: start staged runs;
    a scheduler: publish what it claimed).

    A heartbeat is a compare-and-set on the live incarnation, and no scheduler
    declares a node dead before its last heartbeat is ``silence`` old on the
    database clock. A beat *sent* at monotonic time ``t`` that succeeded
    therefore proves the incarnation live until at least ``t + silence``; the
    lease ends a margin before that (``valid_s`` = silence − margin). A worker whose beats stop succeeding (cut
    off from the database, or paused by SIGSTOP, a long GC or a frozen VM)
    starts nothing staged once the lease has run out, until a beat succeeds
    again — or fails the compare-and-set, and the staged runs are withdrawn
    (:meth:`ax_kombu.worker.node.Worker._fenced`): what another node took over
    meanwhile is never started here.

    Args:
        valid_s: how long a successful beat keeps the lease (silence − margin).
        clock: monotonic seconds.
    """

    def __init__(self, valid_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._valid_s = valid_s
        self._clock = clock
        self._until = 0.0
        #: the incarnation the last confirmed beat was for
        self.incarnation = 0
        self._cond = threading.Condition()

    def confirm(self, sent_at: float, incarnation: int) -> None:
        """A beat (or the registration) of ``incarnation`` sent at ``sent_at`` succeeded."""
        with self._cond:
            if incarnation != self.incarnation:
                self.incarnation, self._until = incarnation, 0.0
            self._until = max(self._until, sent_at + self._valid_s)
            self._cond.notify_all()

    def revoke(self) -> None:
        """The incarnation is no longer live: nothing starts until the next confirm."""
        with self._cond:
            self._until = 0.0

    def valid(self) -> bool:
        """True while the last confirmed beat still covers now."""
        return self._clock() < self._until

    def covers(self, incarnation: int) -> bool | None:
        """May a run fenced under ``incarnation`` start now? True: yes. False: never — a
        later incarnation has the lease (the run was fenced before this worker was
        declared dead; another node may run its task now). None: not yet (the lease has
        run out, or its incarnation's first beat is not confirmed yet)."""
        if not self.valid():
            return None
        if incarnation < self.incarnation:
            return False
        return True if incarnation == self.incarnation else None

    def wait(self, incarnation: int, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until :meth:`covers` decides for ``incarnation`` (it
        is no longer None); True if it has."""
        with self._cond:
            return self._cond.wait_for(lambda: self.covers(incarnation) is not None, timeout_s)
