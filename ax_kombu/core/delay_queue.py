"""A min-heap of keys by due time with lazy deletion: where ``TriggerTimer`` keeps the keys
beyond its wheel's horizon.

Contract: pure, no I/O.  ``add`` of a queued key reschedules it; ``remove`` and a reschedule
leave the old heap entry stale, dropped when it reaches the top or when stale entries
outnumber live ones (so the heap stays within twice the live keys, plus a constant).  Keys
of equal due time come out in insertion order, and keys are never compared.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class DelayQueue(Generic[K]):
    """Min-heap of (due_ms, key) with lazy deletion, for keys beyond the wheel."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, K]] = []
        self._live: dict[K, tuple[int, int]] = {}
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, key: object) -> bool:
        return key in self._live

    def add(self, key: K, due_ms: int) -> None:
        """Schedule (or reschedule) ``key``."""
        self._push(key, due_ms, next(self._seq))

    def remove(self, key: K) -> bool:
        """Cancel ``key``; False if it was not queued.  The heap entry goes stale."""
        if self._live.pop(key, None) is None:
            return False
        self._maybe_compact()
        return True

    def pop_due_before(self, limit_ms: int) -> list[tuple[K, int]]:
        """Remove and return every ``(key, due_ms)`` with ``due_ms < limit_ms``, ascending."""
        return [(key, due_ms) for due_ms, _, key in self._pop_entries(limit_ms)]

    def peek_ms(self) -> int | None:
        """The smallest pending ``due_ms``, or None if empty."""
        self._drop_stale_top()
        return self._heap[0][0] if self._heap else None

    def _push(self, key: K, due_ms: int, seq: int) -> None:
        self._live[key] = (due_ms, seq)
        heapq.heappush(self._heap, (due_ms, seq, key))
        self._maybe_compact()

    def _pop_entries(self, limit_ms: int) -> Iterator[tuple[int, int, K]]:
        self._drop_stale_top()
        while self._heap and self._heap[0][0] < limit_ms:
            due_ms, seq, key = heapq.heappop(self._heap)
            del self._live[key]
            yield due_ms, seq, key
            self._drop_stale_top()

    def _drop_stale_top(self) -> None:
        heap = self._heap
        while heap and self._live.get(heap[0][2]) != heap[0][:2]:
            heapq.heappop(heap)

    def _maybe_compact(self) -> None:
        if len(self._heap) > 2 * len(self._live) + 64:
            self._heap = [e for e in self._heap if self._live.get(e[2]) == e[:2]]
            heapq.heapify(self._heap)
