"""64-bit snowflake task ids: time-ordered, unique across threads, processes and hosts.

Layout (63 bits, always positive in a signed BIGINT)::

    41 bits  milliseconds since 2024-01-01 UTC (good until 2093)
    10 bits  node id, 0..1023
    12 bits  sequence within one millisecond (4096 ids/ms per node)

Uniqueness rests on two facts:

* No two live processes use the same node id. Processes start without any
  coordination of their own, so each *reserves* its node id in the store (an id
  reservation, :mod:`ax_kombu.store.leases`): a process takes a slot whose reservation
  has ended with a conditional UPDATE, and stops using it before its own ends.
* Within one node id the (ms, sequence) pair only grows. The clock read is
  the database clock (so a slot handed from a dead process to a new one on
  another host continues from a comparable time), and if it steps backwards
  the generator keeps issuing from its last millisecond instead of waiting
  or reusing a value; when a millisecond's 4096 sequence numbers run out it
  borrows the next millisecond.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

EPOCH_MS = 1_704_067_200_000  # 2024-01-01T00:00:00Z
NODE_BITS = 10
SEQUENCE_BITS = 12
MAX_NODE = (1 << NODE_BITS) - 1
MAX_SEQUENCE = (1 << SEQUENCE_BITS) - 1


def compose(ms: int, node: int, sequence: int) -> int:
    """The id for epoch millisecond ``ms``, ``node`` and ``sequence``."""
    return ((ms - EPOCH_MS) << (NODE_BITS + SEQUENCE_BITS)) | (node << SEQUENCE_BITS) | sequence


class Snowflake:
    """Ids for one node id. Thread-safe; the clock is injected (epoch ms)."""

    def __init__(self, node: int, clock_ms: Callable[[], int]) -> None:
        if not 0 <= node <= MAX_NODE:
            raise ValueError(f"node id must be 0..{MAX_NODE}, got {node}")
        self.node = node
        self._clock_ms = clock_ms
        self._last_ms = 0
        self._sequence = 0
        self._lock = threading.Lock()

    def next_ids(self, count: int) -> list[int]:
        """``count`` new ids, ascending."""
        with self._lock:
            return [self._next_locked() for _ in range(count)]

    def _next_locked(self) -> int:
        now = self._clock_ms()
        if now > self._last_ms:
            self._last_ms, self._sequence = now, 0
        elif self._sequence < MAX_SEQUENCE:
            self._sequence += 1  # same ms, or the clock stepped back: keep counting
        else:
            self._last_ms, self._sequence = self._last_ms + 1, 0  # borrow the next ms
        return compose(self._last_ms, self.node, self._sequence)


class Reserver(Protocol):
    """Where node ids are reserved (the store)."""

    def acquire(self, owner: str, reservation_ms: int) -> tuple[int, int]:
        """Reserve a free slot: returns ``(slot, reserved_until_ms)``."""

    def renew(self, slot: int, owner: str, reservation_ms: int) -> int | None:
        """Extend our reservation; returns its new end, or None if it was lost."""

    def release(self, slot: int, owner: str) -> None:
        """Give the slot back."""


class ReservedIds:
    """Snowflake ids under a node id reserved in the store, renewed as needed.

    The reservation is renewed when less than a third of it is left, before any id
    is issued, so ids are only ever issued under a reservation that is still valid for
    at least ``reservation_ms / 3`` on the database clock.
    """

    def __init__(self, reserver: Reserver, owner: str, reservation_ms: int,
                 clock_ms: Callable[[], int]) -> None:
        self._reserver = reserver
        self._owner = owner
        self._reservation_ms = reservation_ms
        self._clock_ms = clock_ms
        self._lock = threading.Lock()
        self._slot: int | None = None
        self._until = 0
        self._gen: Snowflake | None = None

    def next_ids(self, count: int) -> list[int]:
        with self._lock:
            return self._generator().next_ids(count)

    def _generator(self) -> Snowflake:
        now = self._clock_ms()
        if self._gen is not None and now < self._until - self._reservation_ms // 3:
            return self._gen
        until = None
        if self._slot is not None:
            until = self._reserver.renew(self._slot, self._owner, self._reservation_ms)
        if until is None:
            self._slot, until = self._reserver.acquire(self._owner, self._reservation_ms)
            self._gen = Snowflake(self._slot, self._clock_ms)
        self._until = until
        assert self._gen is not None
        return self._gen

    @property
    def slot(self) -> int | None:
        return self._slot

    def release(self) -> None:
        with self._lock:
            if self._slot is not None:
                self._reserver.release(self._slot, self._owner)
            self._slot, self._gen, self._until = None, None, 0
