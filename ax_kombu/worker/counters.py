"""The worker's event counters (``Worker.stats``), and :class:`Room`: a count of free places."""

from __future__ import annotations

import threading
from collections import Counter


class Counters:
    """Thread-safe event counters of one worker (until Prometheus metrics replace them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def __getitem__(self, name: str) -> int:
        with self._lock:
            return self._counts[name]


class Room:
    """A count of free places, as :class:`threading.Semaphore`, that wakes a waiter only when
    one waits: CPython 3.11's ``Semaphore.release(n)`` notifies n times in a Python loop,
    which for a batch of outcomes cost more than writing down that they are durable."""

    def __init__(self, places: int) -> None:
        self._free = places
        self._waiting = 0
        self._cond = threading.Condition(threading.Lock())

    def take(self, timeout_s: float) -> bool:
        """Take a place, waiting at most ``timeout_s`` for one; False if none came."""
        with self._cond:
            if self._free <= 0 and timeout_s > 0:
                self._waiting += 1
                try:
                    self._cond.wait(timeout_s)
                finally:
                    self._waiting -= 1
            if self._free <= 0:
                return False
            self._free -= 1
            return True

    def give(self, places: int) -> None:
        """Free ``places`` places, waking as many waiters."""
        with self._cond:
            self._free += places
            if self._waiting:
                self._cond.notify(min(places, self._waiting))
