"""Timing wheel plus overflow heap: the trigger clock of the scheduler.

Contract:

* Pure and passive: no I/O, threads or wall clock.  Time is an ``int`` of milliseconds
  passed in by the caller; an ``advance`` to an earlier time counts as "no time passed".
* Time is cut into ticks of ``tick_ms`` counted from ``start_ms``.  A key fires at the end
  of the tick holding its ``due_ms``: never early, at most ``tick_ms - 1`` ms late (exactly
  on time with 1 ms ticks), and a key on a level boundary fires exactly at its tick.
* ``TimingWheel.add``/``remove`` are O(1) (a constant number of levels).  ``advance``
  costs O(fired + cascaded keys) plus a scan of at most the level sizes per non-empty
  slot it reaches; empty stretches are jumped over, never walked tick by tick.
* ``advance(now_ms)`` returns each key due at or before ``now_ms`` exactly once, in
  ascending ``due_ms`` order, ties in insertion order.
* A key added with ``due_ms <= current_ms`` is never lost: it fires on the next
  ``advance``, whatever its argument.  ``TimingWheel.add`` raises ``ValueError`` beyond
  ``horizon_ms``; ``TriggerTimer`` parks such keys in a ``DelayQueue`` and moves them
  into the wheel once the horizon reaches them.
* Adding a key that is already present reschedules it.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)

#: 512 x 64 x 64 = 2,097,152 ticks: about 34.9 minutes with 1 ms ticks.
DEFAULT_LEVEL_SIZES: tuple[int, ...] = (512, 64, 64)

_OVERDUE = -1  # level marker for keys that fire on the next advance()

# Per-key record: (due_ms, seq, level, slot, tick).  ``seq`` is unique, so
# comparing two records never reaches the remaining fields.
_Entry = tuple[int, int, int, int, int]


class TimingWheel(Generic[K]):
    """Hierarchical timing wheel; see the module docstring for the contract."""

    def __init__(
        self, start_ms: int, tick_ms: int = 1, level_sizes: tuple[int, ...] = DEFAULT_LEVEL_SIZES
    ) -> None:
        if tick_ms < 1:
            raise ValueError(f"tick_ms must be >= 1, got {tick_ms}")
        if not level_sizes or min(level_sizes) < 2:
            raise ValueError(f"level_sizes must be non-empty with sizes >= 2: {level_sizes}")
        self._start = start_ms
        self._tick_ms = tick_ms
        self._sizes = level_sizes
        # _res[i]: ticks per slot of level i; _res[i + 1]: ticks level i spans.
        self._res = [1]
        for size in level_sizes:
            self._res.append(self._res[-1] * size)
        self._slots: list[list[dict[K, None]]] = [[{} for _ in range(s)] for s in level_sizes]
        self._counts = [0] * len(level_sizes)
        #: per level above 0, per slot: [the smallest tick of its keys, how many have it],
        #: kept as keys come and go (absent: not known, counted when next asked for), so
        #: the next due time of a crowded slot is not a walk over its keys every time the
        #: earliest of them is removed (100,000 due at one instant, claimed in batches)
        self._slot_min: list[dict[int, list[int]]] = [{} for _ in level_sizes]
        self._overdue: dict[K, None] = {}
        self._where: dict[K, _Entry] = {}
        self._tick = 0  # every tick <= _tick has been processed
        self._now = start_ms
        self._seq = itertools.count()
        self._cache: int | None = None
        self._cache_ok = True

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key: object) -> bool:
        return key in self._where

    @property
    def current_ms(self) -> int:
        """The latest time passed to ``advance`` (``start_ms`` before any)."""
        return self._now

    @property
    def horizon_ms(self) -> int:
        """The latest ``due_ms`` that ``add`` accepts at the current time."""
        return self._start + (self._tick + self._res[-1] - 1) * self._tick_ms

    def add(self, key: K, due_ms: int) -> None:
        """Schedule (or reschedule) ``key``; ``ValueError`` beyond ``horizon_ms``."""
        self._insert(key, due_ms, next(self._seq))

    def remove(self, key: K) -> bool:
        """Cancel ``key``; False if it was not scheduled."""
        entry = self._where.pop(key, None)
        if entry is None:
            return False
        _, _, level, slot, _ = entry
        if level == _OVERDUE:
            del self._overdue[key]
        else:
            del self._slots[level][slot][key]
            self._counts[level] -= 1
            if level:
                self._forget_tick(level, slot, entry[4])
        if self._cache_ok and self._fire_ms(entry) == self._cache:
            self._cache_ok = False
        return True

    def advance(self, now_ms: int) -> list[K]:
        """Move the clock to ``now_ms`` and return the keys that fire, in due order."""
        now_ms = max(now_ms, self._now)
        fired, overdue = list(self._overdue), len(self._overdue)
        self._overdue = {}
        target = (now_ms - self._start) // self._tick_ms
        event = self._next_event(target)
        while event is not None:
            fired.extend(self._process(event))
            event = self._next_event(target)
        if overdue:  # with coarse ticks an overdue key may be due after a wheel key
            fired.sort(key=self._where.__getitem__)
        for key in fired:
            del self._where[key]
        self._tick = max(self._tick, target)
        self._now = now_ms
        self._cache_ok = False
        return fired

    def next_due_ms(self) -> int | None:
        """When ``advance`` next fires: the smallest due time rounded up to its tick
        (an overdue key reports its own past ``due_ms``), or None if empty."""
        if not self._cache_ok:
            self._cache = self._compute_next_due()
            self._cache_ok = True
        return self._cache

    def _insert(self, key: K, due_ms: int, seq: int) -> None:
        if due_ms > self.horizon_ms:
            raise ValueError(f"due_ms {due_ms} is beyond the wheel horizon {self.horizon_ms}")
        if key in self._where:
            self.remove(key)
        if due_ms <= self._now:
            self._overdue[key] = None
            entry: _Entry = (due_ms, seq, _OVERDUE, 0, 0)
            self._where[key] = entry
        else:
            tick = -((self._start - due_ms) // self._tick_ms)  # ceil division
            entry = self._place(key, due_ms, seq, tick)
        if self._cache_ok and (self._cache is None or self._fire_ms(entry) < self._cache):
            self._cache = self._fire_ms(entry)

    def _place(self, key: K, due_ms: int, seq: int, tick: int) -> _Entry:
        delta, res, level = tick - self._tick, self._res, 0
        while delta >= res[level + 1]:
            level += 1
        slot = (tick // res[level]) % self._sizes[level]
        keys = self._slots[level][slot]
        if level:
            least = self._slot_min[level].get(slot)
            if not keys:
                self._slot_min[level][slot] = [tick, 1]
            elif least is not None:
                if tick < least[0]:
                    least[0], least[1] = tick, 1
                elif tick == least[0]:
                    least[1] += 1
        keys[key] = None
        self._counts[level] += 1
        entry = (due_ms, seq, level, slot, tick)
        self._where[key] = entry
        return entry

    def _fire_ms(self, entry: _Entry) -> int:
        due_ms, _, level, _, tick = entry
        return due_ms if level == _OVERDUE else self._start + tick * self._tick_ms

    def _first_block(self, level: int, limit: int) -> int | None:
        """First block with a non-empty slot at ``level`` that starts in (tick, limit]."""
        if not self._counts[level]:
            return None
        res, size, slots = self._res[level], self._sizes[level], self._slots[level]
        first = self._tick // res + 1
        for block in range(first, min(first + size, limit // res + 1)):
            if slots[block % size]:
                return block
        return None

    def _next_event(self, limit: int) -> int | None:
        """Earliest tick <= ``limit`` at which a slot fires or cascades."""
        event: int | None = None
        for level in range(len(self._sizes)):
            block = self._first_block(level, limit)
            if block is not None:
                event = limit = block * self._res[level]
        return event

    def _process(self, tick: int) -> list[K]:
        """Jump to ``tick``: cascade the higher levels top-down, then fire level 0."""
        self._tick = tick
        for level in range(len(self._sizes) - 1, 0, -1):
            if tick % self._res[level] == 0:
                self._cascade(level, (tick // self._res[level]) % self._sizes[level])
        return self._fire_slot(tick % self._sizes[0])

    def _cascade(self, level: int, slot: int) -> None:
        keys = self._slots[level][slot]
        if not keys:
            return
        self._slots[level][slot] = {}
        self._slot_min[level].pop(slot, None)
        self._counts[level] -= len(keys)
        place, where = self._place, self._where
        for key in keys:
            due_ms, seq, _, _, tick = where[key]
            place(key, due_ms, seq, tick)

    def _fire_slot(self, slot: int) -> list[K]:
        fired = list(self._slots[0][slot])
        if not fired:
            return fired
        self._slots[0][slot] = {}
        self._counts[0] -= len(fired)
        if len(fired) > 1:
            fired.sort(key=self._where.__getitem__)
        return fired

    def _compute_next_due(self) -> int | None:
        if self._overdue:
            return min(self._where[key][0] for key in self._overdue)
        best: int | None = None
        for level in range(len(self._sizes)):
            limit = self._tick + self._res[-1] if best is None else best - 1
            block = self._first_block(level, limit)
            if block is None:
                continue
            tick = block if level == 0 else self._least_tick(level, block % self._sizes[level])
            best = tick if best is None else min(best, tick)
        return None if best is None else self._start + best * self._tick_ms

    def _least_tick(self, level: int, slot: int) -> int:
        """The smallest tick of the keys in a non-empty slot above level 0."""
        least = self._slot_min[level].get(slot)
        if least is None:
            ticks = [self._where[key][4] for key in self._slots[level][slot]]
            least = self._slot_min[level][slot] = [min(ticks), 0]
            least[1] = ticks.count(least[0])
        return least[0]

    def _forget_tick(self, level: int, slot: int, tick: int) -> None:
        """A key of ``tick`` left a slot above level 0: its smallest tick may have changed."""
        least = self._slot_min[level].get(slot)
        if least is not None and tick == least[0]:
            least[1] -= 1
            if not least[1]:  # the last key at the smallest tick: counted again when asked
                del self._slot_min[level][slot]

    def _round_up(self, due_ms: int) -> int:
        """``due_ms`` rounded up to the end of its tick."""
        return self._start - (self._start - due_ms) // self._tick_ms * self._tick_ms

    def _admit_time(self, due_ms: int) -> int:
        """A time after which ``horizon_ms >= due_ms`` (for ``due_ms`` > horizon)."""
        return due_ms - (self._res[-1] - 2) * self._tick_ms - 1


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


class TriggerTimer(Generic[K]):
    """A TimingWheel for the near future backed by a DelayQueue for the rest."""

    def __init__(
        self, start_ms: int, tick_ms: int = 1, level_sizes: tuple[int, ...] = DEFAULT_LEVEL_SIZES
    ) -> None:
        self._wheel: TimingWheel[K] = TimingWheel(start_ms, tick_ms, level_sizes)
        self._delayed: DelayQueue[K] = DelayQueue()
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._wheel) + len(self._delayed)

    def __contains__(self, key: object) -> bool:
        return key in self._wheel or key in self._delayed

    @property
    def wheel_depth(self) -> int:
        return len(self._wheel)

    @property
    def delayed_depth(self) -> int:
        return len(self._delayed)

    @property
    def current_ms(self) -> int:
        return self._wheel.current_ms

    def add(self, key: K, due_ms: int) -> None:
        """Schedule (or reschedule) ``key`` at any time, however far ahead."""
        self.remove(key)
        seq = next(self._seq)
        if due_ms <= self._wheel.horizon_ms:
            self._wheel._insert(key, due_ms, seq)
        else:
            self._delayed._push(key, due_ms, seq)

    def add_earlier(self, key: K, due_ms: int) -> None:
        """Schedule ``key`` at ``due_ms`` unless it is already scheduled no later."""
        held = self.due_ms(key)
        if held is None or due_ms < held:
            self.add(key, due_ms)

    def due_ms(self, key: K) -> int | None:
        """The time ``key`` is scheduled for, or None if it is not."""
        entry = self._wheel._where.get(key)
        if entry is not None:
            return entry[0]
        queued = self._delayed._live.get(key)
        return None if queued is None else queued[0]

    def remove(self, key: K) -> bool:
        """Cancel ``key`` wherever it is; False if it was not scheduled."""
        return self._wheel.remove(key) or self._delayed.remove(key)

    def advance(self, now_ms: int) -> list[K]:
        """Move the clock to ``now_ms``; return the fired keys in due order."""
        fired: list[K] = []
        while True:
            self._promote()
            pending = self._delayed.peek_ms()
            if pending is None or pending > now_ms:
                fired.extend(self._wheel.advance(now_ms))
                return fired
            # Stop the wheel short of ``pending`` but close enough to admit it.
            fired.extend(self._wheel.advance(min(now_ms, self._wheel._admit_time(pending))))

    def next_due_ms(self) -> int | None:
        """Earliest time at which ``advance`` fires something, or None if empty."""
        wheel_due = self._wheel.next_due_ms()
        delayed_due = self._delayed.peek_ms()
        if delayed_due is None:
            return wheel_due
        delayed_due = self._wheel._round_up(delayed_due)
        return delayed_due if wheel_due is None else min(wheel_due, delayed_due)

    def _promote(self) -> None:
        for due_ms, seq, key in self._delayed._pop_entries(self._wheel.horizon_ms + 1):
            self._wheel._insert(key, due_ms, seq)
