"""The database clock is the truth for "is it due"; between measurements it runs on monotonic time.

Each process measures the database clock against its own **monotonic** clock
(NTP-style: of a few samples the one with the shortest round trip wins, and
the database reading is assumed to sit in the middle of it), then reads
database time locally as ``monotonic + base``, measuring again every
``refresh_s`` seconds. The error of one reading is at most half the winning
round trip plus the monotonic clock's drift since the last measurement
(NTP slews it by well under a millisecond a second).

Guarantee: a step of the host's wall clock (an NTP step, a VM resumed,
someone running ``date -s``) does not move database time as this process
reads it, so a task is never fired early or late because of one. The step is
noticed at the next :meth:`DbClock.now_ms` (the wall clock no longer keeps
its distance to the monotonic one), logged once, counted, and the offset is
measured again at once.

The wall clock is read only to report how far it is from the database clock
(:attr:`DbClock.offset_ms`, the skew an operator is warned about).

:meth:`DbClock.now_ms` re-measures when due (a few database round trips);
:meth:`DbClock.local_ms` never does, so a thread that must not wait on the
database (the scheduler's timing loop) reads the clock with it and leaves the
re-measuring to another thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

#: (local ms before the query, database ms, local ms after the query); the database
#: reading must be exact to well under a millisecond (PostgreSQL's is to the microsecond):
#: a reading rounded to whole milliseconds would make :meth:`DbClock.earliest_ms` up to
#: half a millisecond late, and a staged run start that much early
Sample = tuple[float, float, float]

#: how far the wall clock may move against the monotonic one between two readings
#: before it counts as a step (NTP slewing stays far below this)
STEP_MS = 100.0
#: after a failed re-measurement, how long until the next try
RETRY_S = 5.0

log = logging.getLogger(__name__)


def estimate_offset(samples: Sequence[Sample]) -> tuple[float, float]:
    """The ``(offset_ms, round_trip_ms)`` of the sample with the shortest round trip."""
    if not samples:
        raise ValueError("no clock samples")
    before, db, after = min(samples, key=lambda s: s[2] - s[0])
    return db - (before + after) / 2.0, after - before


def _monotonic_ms() -> float:
    return time.monotonic() * 1000.0


def _wall_ms() -> float:
    return time.time() * 1000.0


class DbClock:
    """Milliseconds on the database clock, read locally between measurements.

    Args:
        read_db_ms: one round trip to the database returning its clock in ms.
        refresh_s: how often the offset is measured again.
        mono_ms: the local monotonic clock in ms (injected for tests).
        wall_ms: the local wall clock in ms (injected for tests); only reported.
        samples: round trips per measurement.
    """

    def __init__(self, read_db_ms: Callable[[], float], *, refresh_s: float = 30.0,
                 mono_ms: Callable[[], float] = _monotonic_ms,
                 wall_ms: Callable[[], float] = _wall_ms, samples: int = 3) -> None:
        self._read_db_ms = read_db_ms
        self._refresh_ms = refresh_s * 1000.0
        self._mono_ms = mono_ms
        self._wall_ms = wall_ms
        self._samples = samples
        self._lock = threading.Lock()
        self._next_sync: float | None = None  # monotonic ms; None before the first success
        self._base_ms = 0.0  # database ms − monotonic ms
        self._wall_gap = 0.0  # wall ms − monotonic ms, as last seen
        #: database ms − wall ms at the last measurement (the skew to report)
        self.offset_ms = 0.0
        self.round_trip_ms = 0.0
        #: wall-clock steps noticed so far
        self.steps = 0

    def sync(self) -> float:
        """Measure the database clock now; returns the wall clock's offset to it in ms."""
        samples: list[Sample] = []
        gaps: list[float] = []
        for _ in range(self._samples):
            before = self._mono_ms()
            db = self._read_db_ms()
            after = self._mono_ms()
            samples.append((before, db, after))
            gaps.append(self._wall_ms() - after)
        self._base_ms, self.round_trip_ms = estimate_offset(samples)
        self._wall_gap = gaps[-1]
        self.offset_ms = self._base_ms - self._wall_gap
        self._next_sync = self._mono_ms() + self._refresh_ms
        return self.offset_ms

    def now_ms(self) -> int:
        """The database time now, in epoch milliseconds (measuring again when due).

        If a re-measurement fails after a first success, the last measurement is
        kept and retried a few seconds later (the database may be restarting);
        the first measurement's failure propagates.
        """
        if self._sync_due():
            with self._lock:
                if self._sync_due():
                    self._resync()
        return int(self._mono_ms() + self._base_ms)

    def local_ms(self) -> float:
        """The database time now from the last measurement, with no database round trip.

        Exact to the same bound as :meth:`now_ms` as long as some thread keeps
        calling :meth:`now_ms` (or :meth:`sync`) so the measurement stays fresh.
        """
        return self._mono_ms() + self._base_ms

    def earliest_ms(self) -> float:
        """The earliest the database time can be now (:meth:`local_ms` less half the
        measurement's round trip, its uncertainty): waiting until this reaches a time
        never ends before that time."""
        return self._mono_ms() + self._base_ms - self.round_trip_ms / 2.0

    def _sync_due(self) -> bool:
        return (self._next_sync is None or self._mono_ms() >= self._next_sync
                or self._wall_stepped())

    def _wall_stepped(self) -> bool:
        """True once per step of the wall clock against the monotonic one."""
        gap = self._wall_ms() - self._mono_ms()
        jump = gap - self._wall_gap
        if abs(jump) < STEP_MS:
            return False
        self._wall_gap = gap
        self._next_sync = self._mono_ms()  # measure again now (also for a thread racing us)
        self.steps += 1
        log.warning("the wall clock stepped; database time is unaffected, measuring again",
                    extra={"step_ms": round(jump, 1)})
        return True

    def _resync(self) -> None:
        try:
            self.sync()
        except Exception:
            if not self.synced:
                raise
            log.warning("could not re-measure the database clock; keeping the last measurement",
                        exc_info=True)
            self._next_sync = self._mono_ms() + RETRY_S * 1000.0

    @property
    def synced(self) -> bool:
        return self._next_sync is not None
