"""The database clock is the truth for "is it due".

Each process measures its offset to the database clock (NTP-style: the
sample with the shortest round trip wins, the database reading is assumed
to sit in the middle of it) and then reads time locally as
``wall clock + offset``, re-measuring every ``refresh_s`` seconds. The
error of one reading is at most half the winning round trip.

:meth:`DbClock.now_ms` re-measures when the offset is due for it (a few
database round trips); :meth:`DbClock.local_ms` never does, so a thread that
must not wait on the database (the scheduler's timing loop) reads the clock
with it and leaves the re-measuring to another thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

#: (local ms before the query, database ms, local ms after the query)
Sample = tuple[float, int, float]

log = logging.getLogger(__name__)


def estimate_offset(samples: Sequence[Sample]) -> tuple[float, float]:
    """The ``(offset_ms, round_trip_ms)`` of the sample with the shortest round trip."""
    if not samples:
        raise ValueError("no clock samples")
    before, db, after = min(samples, key=lambda s: s[2] - s[0])
    return db - (before + after) / 2.0, after - before


class DbClock:
    """Milliseconds on the database clock, read locally between measurements.

    Args:
        read_db_ms: one round trip to the database returning its clock in ms.
        refresh_s: how often the offset is measured again.
        wall_ms: the local clock (injected for tests).
    """

    def __init__(self, read_db_ms: Callable[[], int], *, refresh_s: float = 30.0,
                 wall_ms: Callable[[], float] = lambda: time.time() * 1000.0,
                 samples: int = 3) -> None:
        self._read_db_ms = read_db_ms
        self._refresh_s = refresh_s
        self._wall_ms = wall_ms
        self._samples = samples
        self._lock = threading.Lock()
        self._next_sync = 0.0
        self.offset_ms = 0.0
        self.round_trip_ms = 0.0

    def sync(self) -> float:
        """Measure the offset now; returns it in ms."""
        samples = []
        for _ in range(self._samples):
            before = self._wall_ms()
            db = self._read_db_ms()
            samples.append((before, db, self._wall_ms()))
        self.offset_ms, self.round_trip_ms = estimate_offset(samples)
        self._next_sync = time.monotonic() + self._refresh_s
        return self.offset_ms

    def now_ms(self) -> int:
        """The database time now, in epoch milliseconds.

        If a re-measurement fails after a first success, the last offset is
        kept and the measurement retried a few seconds later (the database may
        be restarting); the first measurement's failure propagates.
        """
        if time.monotonic() >= self._next_sync:
            with self._lock:
                if time.monotonic() >= self._next_sync:
                    self._resync()
        return int(self._wall_ms() + self.offset_ms)

    def local_ms(self) -> float:
        """The database time now from the last measured offset, with no database round trip.

        Exact to the same bound as :meth:`now_ms` as long as some thread keeps
        calling :meth:`now_ms` (or :meth:`sync`) so the offset stays fresh.
        """
        return self._wall_ms() + self.offset_ms

    def _resync(self) -> None:
        try:
            self.sync()
        except Exception:
            if not self.synced:
                raise
            log.warning("could not re-measure the database clock; keeping the last offset",
                        exc_info=True)
            self._next_sync = time.monotonic() + 5.0

    @property
    def synced(self) -> bool:
        return self._next_sync > 0
