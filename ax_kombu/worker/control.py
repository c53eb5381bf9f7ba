"""How the worker's threads signal the consuming thread: its wake-up event and the stop flags.

Only the consuming thread acts (it owns the broker connection); every other
thread — pool threads, receipt writers, the Redis puller, signal handlers —
only rings :class:`Wakeup` or sets :class:`StopFlags`, and the consuming
thread looks at them at least every :data:`TICK_S`. Whether the worker's
incarnation is still certainly live is :class:`ax_kombu.core.lease.Lease`'s to say.
"""

from __future__ import annotations

import threading

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
