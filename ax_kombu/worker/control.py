"""How the worker's threads signal the consuming thread: its wake-up event and the stop flags.

Only the consuming thread acts (it owns the broker connection); every other
thread — pool threads, receipt writers, the Redis puller, signal handlers —
only rings :class:`Wakeup` or sets :class:`StopFlags`, and the consuming
thread looks at them at least every :data:`TICK_S`. :class:`Lease` tells the
pool threads whether the worker's incarnation is still certainly live.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

#: longest the consuming thread blocks (on the broker or its wake-up) before checking flags
TICK_S = 0.01


class Wakeup(threading.Event):
    """The consuming thread's doorbell: set when there is something for it to settle.

    The consuming thread clears it at the top of each loop, then looks at
    everything put before the last :meth:`poke`.
    """

    def poke(self) -> None:
        """Wake the consuming thread (from any thread).

        Setting an Event takes its lock and notifies; when it is already set the
        consuming thread has not cleared it yet and will look at everything put
        before this call, so the set is skipped (it was most of a pool thread's
        work per task).
        """
        if not self.is_set():
            self.set()


class StopFlags:
    """What a stop request asked for; set from signal handlers, read by every stage.

    Attributes:
        stopping: a stop was requested (warm unless :attr:`cold`).
        cold: do not wait for running tasks.
    """

    __slots__ = ("cold", "stopping")

    def __init__(self) -> None:
        self.stopping = False
        self.cold = False

    def request(self, cold: bool = False) -> None:
        """Warm stop; cold if ``cold`` or if a stop was already requested. Only sets flags."""
        if cold or self.stopping:
            self.cold = True
        self.stopping = True


class Lease:
    """How long this worker may still start work under its incarnation.

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
        later incarnation holds the lease (the run was fenced before this worker was
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
