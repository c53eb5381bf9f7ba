"""A quiet worker: it takes no new work, finishes what runs, and stays alive.

Asked for by ``ax workers quiet NAME`` (the node row's ``quiet_at``, which every beat
reads back, :class:`~ax_kombu.store.nodes.Heartbeat`) or by ``SIGTSTP`` to the process
(quiet at once; the next beat writes ``quiet_at``, so ``ax workers`` shows it and
``ax workers resume`` undoes it). ``ax workers resume NAME`` clears ``quiet_at``: the
worker consumes again within one heartbeat. No signal resumes (Sidekiq's ``TSTP`` has
no twin either); a new process of the name starts consuming.

Going quiet, on the consuming thread (:meth:`Quiet.follow`):

1. the broker hands over nothing more: each lane's Kombu consumer is cancelled (what
   the broker had already sent arrives before the cancel is confirmed and lands with
   the received runs), or the Redis puller's room is set to 0;
2. what was received and not started goes back to READY and its messages are acked,
   as at a warm stop (:meth:`~ax_kombu.worker.shutdown.Shutdown.hand_back`; if the
   database fails they are rejected with requeue instead);
3. the staged runs (fenced RUNNING, waiting for a thread or for their trigger time) are
   withdrawn and go RUNNING → DELAYED at the same attempt
   (:meth:`~ax_kombu.worker.shutdown.Shutdown.hand_back_staged`): a scheduler claims
   them again and another worker runs them; none has called its processor. If that
   write fails it is retried each loop while the worker lives;
4. running tasks go on, end, and are acked as usual; the heartbeat goes on, and its
   info says ``quiet``.

While quiet, whatever still arrives (a value the puller popped as its room fell) is
handed back the same way. Resuming gives each lane its prefetch back
(:meth:`~ax_kombu.worker.lanes.Lane.apply`), and the worker consumes again. A stop
while quiet is the usual warm or cold stop.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable, Sequence

from ax_kombu.store.nodes import Heartbeat
from ax_kombu.worker.intake import Intake
from ax_kombu.worker.lanes import Lane
from ax_kombu.worker.run import Run
from ax_kombu.worker.shutdown import Shutdown

log = logging.getLogger(__name__)


class Quiet:
    """Whether this worker is asked to be quiet, and the consuming thread's acting on it.

    :meth:`request` (a signal handler) and :meth:`after_beat` (the heartbeat's thread)
    only set :attr:`wanted`; :meth:`follow` and :meth:`hand_back` run on the consuming
    thread, which alone changes :attr:`active`.

    Args:
        intake: whose received and staged runs are handed back.
        shutdown: the hand-back steps shared with the warm stop.
        node_id: for the log.
    """

    def __init__(self, intake: Intake, shutdown: Shutdown, node_id: str) -> None:
        self._intake = intake
        self._shutdown = shutdown
        self._node = node_id
        #: asked to be quiet (by the row's quiet_at or a signal)
        self.wanted = False
        #: the consuming thread has gone quiet (the heartbeat's info says so)
        self.active = False
        #: a signal asked, and no beat has written quiet_at for it yet
        self._asked = False
        #: withdrawn runs whose rows could not be handed back yet
        self._owed: list[Run[Lane]] = []

    # -- the askers ------------------------------------------------------------------------

    def request(self) -> None:
        """Be quiet now, and have the next beat store it (safe from a signal handler)."""
        self._asked = True
        self.wanted = True

    def before_beat(self, heartbeat: Heartbeat) -> None:
        """Have the coming beat write ``quiet_at`` if a signal asked for it."""
        heartbeat.ask_quiet = self._asked

    def after_beat(self, heartbeat: Heartbeat, landed: bool) -> None:
        """Follow the row's ``quiet_at`` as the beat read it back."""
        if landed and heartbeat.ask_quiet and heartbeat.quiet_at is not None:
            self._asked = False
        heartbeat.ask_quiet = False
        self.wanted = heartbeat.quiet_at is not None or self._asked

    # -- the consuming thread --------------------------------------------------------------

    def follow(self, lanes: Sequence[Lane]) -> None:
        """Go quiet, or resume, if :attr:`wanted` changed (once per loop)."""
        if self.wanted and not self.active:
            self.active = self._intake.quiet = True
            hush(lanes)
            log.info("worker quiet: it takes no new work", extra={"node": self._node})
            self.hand_back()
        elif not self.wanted and self.active:
            self.active = self._intake.quiet = False  # the next settle gives the prefetch back
            log.info("worker resumed: it takes work again", extra={"node": self._node})

    def attached(self, lanes: Sequence[Lane]) -> None:
        """A new connection attached the lanes: hush them again if quiet."""
        if self.active:
            hush(lanes)

    def hand_back(self) -> None:
        """Hand back what was received and not started, and what waits in the stage."""
        intake = self._intake
        if intake.pending or intake.receipts.in_flight or any(lane.backlog
                                                              for lane in intake.lanes):
            self._shutdown.hand_back()
        staged = intake.withdraw()
        if staged:
            intake.starter.wake(staged, reason="quiet")
            log.info("quiet: staged runs withdrawn", extra={"node": self._node,
                                                           "count": len(staged)})
        owed = self._owed + staged
        if owed:
            self._owed = [] if self._shutdown.hand_back_staged(owed) else owed


def hush(lanes: Sequence[Lane]) -> None:
    """Take nothing more from the broker: cancel each lane's consumer, or give its puller
    no room (consuming thread only)."""
    for lane in lanes:
        if lane.pulled is not None:
            lane.prefetch = 0
            lane.pulled(0)
        elif lane.consumer is not None and lane.consuming:
            lane.consumer.cancel()
            lane.consuming = False


def install_quiet_signal(request: Callable[[], None]) -> None:
    """SIGTSTP asks for quiet (instead of suspending the process). Call from the main
    thread; the handler only sets a flag."""
    signal.signal(signal.SIGTSTP, lambda _sig, _frame: request())
