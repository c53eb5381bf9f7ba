"""The timing loop: the wheel's only user; fires due ids to the claimer, never waits on I/O.

Contracts:

* The loop owns the :class:`~ax_kombu.core.wheel.TriggerTimer` — an 8 s
  millisecond wheel (``WHEEL_LEVELS``) in front of a delay queue for the rest
  of the preload window. Only the loop adds to it or advances it; other
  threads may read its sizes.
* Other threads hand it ``(task_id, due_ms)`` pairs with
  :meth:`TimingLoop.hand`; the loop adds them ``ABSORB_CHUNK`` at a time
  between two firings, so a large preload never holds firing up for long.
  An id it has already loaded keeps the earlier of its two times: a time handed
  over may be out of date (an ``ax_due`` entry whose task has moved on,
  :mod:`ax_kombu.store.preload`), and firing early only costs a claim that
  refuses it and hands the id back at its real time
  (:meth:`ax_kombu.scheduler.claimer.Claimer._keep_unclaimed`), where firing
  late would make the task late.
* An id fires ``claim_lead_ms`` before it is due, in trigger order, into the
  claimer's mailbox (:mod:`ax_kombu.scheduler.claimer`), so that the claim,
  the publish and the worker's RUNNING commit are over by the due time (the
  task is published ahead: the worker keeps it in a stage until its trigger time, see
  :mod:`ax_kombu.worker.starts`). Firing is a slot lookup, never a scan.
* **The claim window**: when the next id reaches its lead, every id due up to
  ``claim_window_ms`` after it fires with it, so a stream's next few milliseconds are one
  claim and one publish, not one each (and fewer RUNNING commits in the workers); no id
  fires later than its lead. A wake-up for anything else (ids handed over) fires nothing
  before then.
  With no lead (``claim_lead_ms`` 0: nothing is claimed before it is due) there is no window.
* **Solo ids** fire at their own time, never early with a window: those the claim skipped
  as not due yet (a runner with a fixed lead, :mod:`ax_kombu.core.runners`, which no claim
  takes before its time) and handed back with :meth:`TimingLoop.hand_solo`. One met in a
  window before the claimer has seen it is skipped once, then fires on its own.
* The loop reads the database clock locally
  (:meth:`ax_kombu.store.clock.DbClock.local_ms`) and never touches the
  database or the broker, so a slow preload, claim or clock re-measurement
  never makes it late. It sleeps until the next id is due, ids are handed
  over, or a stop.
* :meth:`TimingLoop.stop` sets a flag and an event, nothing else: safe from a
  signal handler.
* :meth:`TimingLoop.drop_all` (a node declared dead stops acting under its old
  incarnation): the next pass forgets every id in the wheel, every id handed
  over and every fired id not yet claimed.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence

from ax_kombu.config import Settings
from ax_kombu.core.wheel import TriggerTimer
from ax_kombu.scheduler.loop import MAX_SLEEP_S, Mailbox
from ax_kombu.store.clock import DbClock

#: the wheel's levels: 256 × 32 one-millisecond ticks ≈ 8.2 s; later tasks wait in the delay queue
WHEEL_LEVELS = (256, 32)
#: most ids the timing loop adds to the wheel between two firings (bounds its pause)
ABSORB_CHUNK = 2000

#: (task_id, due_ms) pairs handed to the timing loop
Pairs = Sequence[tuple[int, int]]


class _Solo(list[tuple[int, int]]):
    """Pairs handed over by :meth:`TimingLoop.hand_solo`: ids that fire at their own time."""


class TimingLoop:
    """Adds handed-over ids to the wheel and fires due ids into ``fired``; :meth:`run` until
    :meth:`stop`, on the caller's thread.

    Args:
        settings: ``claim_lead_ms``, ``claim_window_ms`` and ``republish_delay_ms`` are read.
        clock: the database clock, read locally only.
        fired: the claimer's mailbox.
    """

    def __init__(self, settings: Settings, clock: DbClock, fired: Mailbox[int]) -> None:
        self._lead_ms = settings.claim_lead_ms
        self._window_ms = settings.claim_reach_ms - settings.claim_lead_ms
        self._republish_delay_ms = settings.republish_delay_ms
        self._clock = clock
        self._fired = fired
        now = int(time.time() * 1000)  # replaced by database time in start_at()
        self.timer: TriggerTimer[int] = TriggerTimer(now, level_sizes=WHEEL_LEVELS)
        #: ids for the wheel; read by this loop alone (``ready`` also wakes it for a stop)
        self.incoming: Mailbox[Pairs] = Mailbox()
        self._stopping = False
        self._drop = False
        #: solo ids (see the module docstring) → their time; and those a window fired early,
        #: kept back out of the wheel until their time, as a heap of (time, id)
        self._solo: dict[int, int] = {}
        self._kept: list[tuple[int, int]] = []

    # -- control (any thread) ------------------------------------------------------------

    def start_at(self, now_ms: int) -> None:
        """Begin the wheel afresh at ``now_ms`` (database time); before :meth:`run`."""
        self.timer = TriggerTimer(now_ms, level_sizes=WHEEL_LEVELS)

    def stop(self) -> None:
        """End :meth:`run` after the current pass. Signal-safe: sets a flag and an event."""
        self._stopping = True
        self.incoming.ready.set()

    def drop_all(self) -> None:
        """From any thread: forget everything loaded, at the start of the next pass."""
        self._drop = True
        self.incoming.ready.set()

    @property
    def dropping(self) -> bool:
        """A :meth:`drop_all` not yet done: what is handed over now would be dropped too."""
        return self._drop

    def idle(self, seconds: float) -> None:
        """Before :meth:`run`: sleep ``seconds``, less if :meth:`stop` is called meanwhile."""
        self.incoming.ready.wait(seconds)

    def hand(self, pairs: Pairs) -> None:
        """From any thread: have the loop schedule ``(task_id, due_ms)`` pairs."""
        if pairs:
            self.incoming.put(pairs[start:start + ABSORB_CHUNK]
                              for start in range(0, len(pairs), ABSORB_CHUNK))

    def hand_solo(self, pairs: Pairs) -> None:
        """From any thread: ``hand`` for ids that must fire at their own time, never early
        with a claim window (the claim skipped them as not due yet)."""
        if pairs:
            self.incoming.put([_Solo(pairs)])

    def retry_later(self, ids: Sequence[int]) -> None:
        """Fire ``ids`` again after ``republish_delay_ms`` (this node still has them claimed)."""
        due = int(self._clock.local_ms()) + self._republish_delay_ms
        self.hand([(task_id, due) for task_id in ids])

    # -- the loop ------------------------------------------------------------------------

    def run(self) -> None:
        """Fire ids until :meth:`stop`."""
        while not self._stopping:
            self.run_once()

    def run_once(self) -> None:
        """One pass: take in handed-over ids, fire what is due to the claimer, sleep."""
        if self._drop:
            self._drop_now()
        self._absorb()
        now = self._clock.local_ms()
        horizon = int(now) + self._lead_ms  # the claim's lead, see above
        reach = horizon
        if self._window_ms and (due := self.timer.next_due_ms()) is not None and due <= horizon:
            reach += self._window_ms  # the claim window, see above
        fired = self.timer.advance(reach)
        if self._solo or self._kept:
            fired = self._solo_on_time(fired, horizon)
        if fired:
            self._fired.put(fired)
        self._sleep(now)

    def _solo_on_time(self, fired: list[int], horizon: int) -> list[int]:
        """Of ``fired``, the solo ids not due by ``horizon`` are kept back; those kept back
        that are due by then join what fires."""
        solo, kept = self._solo, self._kept
        out = []
        for key in fired:
            at = solo.get(key)
            if at is None:
                out.append(key)
            elif at > horizon:
                heapq.heappush(kept, (at, key))
            else:
                del solo[key]
                out.append(key)
        while kept and kept[0][0] <= horizon:
            key = heapq.heappop(kept)[1]
            if solo.pop(key, None) is not None:  # else it fired from the wheel meanwhile
                out.append(key)
        return out

    def _drop_now(self) -> None:
        self._drop = False
        self.incoming.items.clear()
        self._fired.items.clear()
        self._solo.clear()
        self._kept.clear()
        self.timer = TriggerTimer(int(self._clock.local_ms()), level_sizes=WHEEL_LEVELS)

    def _absorb(self) -> None:
        """Add handed-over ids to the wheel, about ``ABSORB_CHUNK`` per pass so firing goes on."""
        incoming = self.incoming.items
        taken = 0
        while incoming and taken < ABSORB_CHUNK:
            pairs = incoming.popleft()
            if type(pairs) is _Solo:
                self._solo.update(pairs)
            self.timer.add_earlier_many(pairs)
            taken += len(pairs)

    def _sleep(self, now: float) -> None:
        """Until the next id is due, ids are handed over, or a stop (at most MAX_SLEEP_S)."""
        if self.incoming.items or self._stopping:
            return
        timeout = MAX_SLEEP_S
        next_due = self.timer.next_due_ms()
        if self._kept and (next_due is None or self._kept[0][0] < next_due):
            next_due = self._kept[0][0]
        if next_due is not None:
            timeout = min(timeout, (next_due - self._lead_ms - now) / 1000.0)
        if timeout > 0:
            self.incoming.wait(timeout)
