"""Timing wheel plus overflow heap: the trigger clock of the scheduler.

Contract:

* Pure and passive: no I/O, threads or wall clock.  Time is an ``int`` of milliseconds
  passed in by the caller; an ``advance`` to an earlier time counts as "no time passed".
* Time is cut into ticks of ``tick_ms`` counted from ``start_ms``.  A key fires at the end
  of the tick that contains its ``due_ms``: never early, at most ``tick_ms - 1`` ms late
  (exactly on time with 1 ms ticks), and a key on a level boundary fires exactly at its tick.
* ``add``/``remove`` are O(1).  ``advance`` costs O(fired keys + cascaded ticks) plus a few
  integer operations per level for each tick that fires or cascades; empty stretches are
  jumped over, and an ``advance`` before the next such tick returns at once.  ``next_due_ms``
  is kept by most changes, else costs those operations and a minimum over one slot's ticks.
* ``advance(now_ms)`` returns each key due at or before ``now_ms`` exactly once, in
  ascending ``due_ms`` order, ties in insertion order.
* A key added with ``due_ms <= current_ms`` is never lost: it fires on the next
  ``advance``, whatever its argument.  ``TimingWheel.add`` raises ``ValueError`` beyond
  ``horizon_ms``; ``TriggerTimer`` parks such keys in a ``DelayQueue`` and moves them
  into the wheel once the horizon reaches them.
* Adding a key that is already present reschedules it.

Shape, for the scheduler's use (bursts of ids due in one millisecond, added in batches, fired
in 1 ms passes): the keys of a tick share a bucket (an insertion-ordered dict), the levels
file ticks, not keys, and a bitmap per level finds the next non-empty slot.  A cancel leaves
an emptied tick filed (it fires nothing) until it comes or ``next_due_ms`` meets it.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Hashable, Iterable
from typing import Generic, TypeVar

from ax_kombu.core.delay_queue import DelayQueue

K = TypeVar("K", bound=Hashable)

#: 512 x 64 x 64 = 2,097,152 ticks: about 34.9 minutes with 1 ms ticks.
DEFAULT_LEVEL_SIZES: tuple[int, ...] = (512, 64, 64)

_OVERDUE = -1  # the bucket of keys that fire on the next advance(), whatever its time
_NEVER = 1 << 62  # the next event of a wheel with no ticks filed


class _Wheel(Generic[K]):
    """The wheel's mechanics, shared by ``TimingWheel`` and ``TriggerTimer``."""

    def __init__(
        self, start_ms: int, tick_ms: int = 1, level_sizes: tuple[int, ...] = DEFAULT_LEVEL_SIZES
    ) -> None:
        if tick_ms < 1:
            raise ValueError(f"tick_ms must be >= 1, got {tick_ms}")
        if not level_sizes or min(level_sizes) < 2:
            raise ValueError(f"level_sizes must be non-empty with sizes >= 2: {level_sizes}")
        self._start, self._tick_ms, self._sizes = start_ms, tick_ms, level_sizes
        # _res[i]: ticks per slot of level i; _res[i + 1]: ticks level i spans.
        self._res = [math.prod(level_sizes[:level]) for level in range(len(level_sizes) + 1)]
        #: tick -> its keys in insertion order, the firing order unless ``tick_ms`` > 1 or
        #: the tick is in ``_unsorted`` (a key came back from the queue with an older seq)
        self._buckets: dict[int, dict[K, None]] = {}
        self._unsorted: set[int] = set()
        #: per level above 0, per slot: the ticks filed there; ``_occupied[level]`` has bit ``i``
        #: set while slot ``i`` is not.  Level 0 is bits alone: its ticks lie in (tick, tick + size).
        self._slots: list[list[set[int]]] = [[]] + [[set() for _ in range(s)] for s in level_sizes[1:]]
        self._occupied = [0] * len(level_sizes)
        self._overdue: dict[K, None] = {}
        self._buckets[_OVERDUE] = self._overdue
        #: key -> (due_ms, seq, tick or ``_OVERDUE``); seq is unique; ints, which the GC skips
        self._where: dict[K, tuple[int, int, int]] = {}
        self._delayed: DelayQueue[K] = DelayQueue()  # keys beyond the horizon (TriggerTimer)
        self._queued = self._delayed._live
        self._tick, self._now = 0, start_ms  # every tick <= _tick has been processed
        self._seq = 0  # the last insertion number given out
        self._cache: int | None = None  # next_due_ms() while _cache_ok
        self._cache_ok = True
        self._event = _NEVER  # no slot fires or cascades (nor queue work) before this tick

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
        self._seq += 1
        self._insert(key, due_ms, self._seq)

    def remove(self, key: K) -> bool:
        """Cancel ``key``; False if it was not scheduled."""
        entry = self._where.pop(key, None)
        if entry is None:
            return self._unqueue(key)
        bucket = self._buckets[tick := entry[2]]
        del bucket[key]
        if tick == _OVERDUE:  # the next due time may have been its own
            self._cache_ok = self._cache_ok and entry[0] != self._cache
        elif not bucket and self._cache_ok:  # its tick may have been the next due time
            self._cache_ok = self._start + tick * self._tick_ms != self._cache
        return True

    def advance(self, now_ms: int) -> list[K]:
        """Move the clock to ``now_ms`` and return the keys that fire, in due order."""
        now_ms = max(self._now, now_ms)
        target = (now_ms - self._start) // self._tick_ms
        if self._event > target and not self._overdue:  # nothing to do yet: most passes
            self._now, self._tick = now_ms, target  # _tick <= target: time only goes forward
            return []
        return self._fire(now_ms) if self._queued else self._turn(now_ms)

    def next_due_ms(self) -> int | None:
        """When ``advance`` next fires: the smallest due time rounded up to its tick
        (an overdue key reports its own past ``due_ms``), or None if empty."""
        if not self._cache_ok:
            self._cache, self._cache_ok = self._compute_next_due(), True
        return self._cache

    def _turn(self, now_ms: int) -> list[K]:
        """``advance`` when a slot fires or cascades by ``now_ms`` (>= now) or a key is overdue."""
        self._now, tick_ms, unsorted, occupied = now_ms, self._tick_ms, self._unsorted, self._occupied
        target, event = (now_ms - self._start) // tick_ms, max(self._event, self._tick + 1)
        overdue, buckets, where, size, res1 = self._overdue, self._buckets, self._where, self._sizes[0], self._res[1]
        fired, late = list(overdue), bool(overdue)  # due on this advance, whatever its time
        overdue.clear()
        while event <= target:
            self._tick = event
            if event % res1 == 0:
                self._cascade(event)
            if (bucket := buckets.pop(event, None)) is not None:  # its level-0 slot's only tick
                if unsorted or tick_ms > 1:
                    if len(bucket) > 1 and (tick_ms > 1 or event in unsorted):
                        bucket = dict.fromkeys(sorted(bucket, key=where.__getitem__))
                    unsorted.discard(event)
                occupied[0] &= ~(1 << event % size)
                fired += bucket
            later = occupied[0] >> (event + 1) % size  # the next tick in this lap, if any
            if later and (event + 1) % size:  # else a lap ends (a cascade): _next_event
                event += (later & -later).bit_length()
            else:
                event = self._next_event()
        if late:  # with coarse ticks an overdue key may be due after a wheel key
            fired.sort(key=where.__getitem__)
        for key in fired:
            del where[key]
        self._tick, self._event = target, event  # every event <= target is processed
        # an event that fires keys (not only cascades) is the next due time
        self._cache_ok = event == _NEVER or bool(buckets.get(event))
        self._cache = None if event == _NEVER else self._start + event * self._tick_ms
        return fired

    _fire = _turn  # ``advance`` when keys wait beyond the horizon: TriggerTimer's

    def _insert(self, key: K, due_ms: int, seq: int) -> None:
        if due_ms > self.horizon_ms:
            raise ValueError(f"due_ms {due_ms} is beyond the wheel horizon {self.horizon_ms}")
        if key in self._where:
            self.remove(key)
        if due_ms <= self._now:
            self._overdue[key] = None
            self._where[key] = (due_ms, seq, _OVERDUE)
            self._sooner(due_ms)
            return
        tick = -((self._start - due_ms) // self._tick_ms)  # ceil division
        bucket = self._buckets.get(tick)
        if bucket is None:
            bucket = self._buckets[tick] = {}
            self._file((tick,))
        elif not bucket:  # left filed by removes: due again
            self._sooner(self._start + tick * self._tick_ms)
        elif seq < self._where[next(reversed(bucket))][1]:  # an older key (from the queue)
            self._unsorted.add(tick)
        bucket[key] = None
        self._where[key] = (due_ms, seq, tick)

    def _unqueue(self, key: K) -> bool:  # remove() of a key not in the wheel
        return False

    def _file(self, ticks: Collection[int]) -> None:
        """File ticks (given their first key, or cascading) by their distance from now."""
        if not ticks:
            return
        res, sizes, slots, occupied, now = self._res, self._sizes, self._slots, self._occupied, self._tick
        size, event = sizes[0], min(self._event, min(ticks))  # a level-0 tick fires then
        for tick in ticks:
            delta = tick - now
            if delta < size:  # level 0: its bit
                occupied[0] |= 1 << tick % size
                continue
            level = 1
            while delta >= res[level + 1]:
                level += 1
            slots[level][slot := tick // res[level] % sizes[level]].add(tick)
            occupied[level] |= 1 << slot
            if (cascade := tick - tick % res[level]) < event:  # the slot's block starts then
                event = cascade
        self._event = event
        self._sooner(self._start + min(ticks) * self._tick_ms)

    def _sooner(self, fire_ms: int) -> None:
        """Something new fires at ``fire_ms``: keep a known next due time right."""
        if self._cache_ok and (self._cache is None or fire_ms < self._cache):
            self._cache = fire_ms

    def _unfile(self, tick: int) -> None:
        """Take a tick that has no keys left out of its slot."""
        self._unsorted.discard(tick)
        size = self._sizes[0]
        if tick - self._tick < size and self._occupied[0] >> tick % size & 1:
            self._occupied[0] &= ~(1 << tick % size)
            return
        for level in range(1, len(self._sizes)):
            slots, slot = self._slots[level], tick // self._res[level] % self._sizes[level]
            if tick in slots[slot]:
                slots[slot].discard(tick)
                self._occupied[level] &= ~(0 if slots[slot] else 1 << slot)
                break

    def _first_block(self, level: int, limit: int) -> int | None:
        """First block with a non-empty slot at ``level`` that starts in (tick, limit]."""
        occupied = self._occupied[level]
        if not occupied:
            return None
        res, size = self._res[level], self._sizes[level]
        start = (first := self._tick // res + 1) % size
        # the slots from ``start`` on, then those before it
        later = occupied >> start or (occupied & ((1 << start) - 1)) << (size - start)
        block = first + (later & -later).bit_length() - 1
        return block if block <= limit // res else None

    def _next_event(self) -> int:
        """Earliest tick at which a slot fires or cascades, else ``_NEVER``."""
        now, occupied, size = self._tick, self._occupied[0], self._sizes[0]
        event, limit = _NEVER, now + self._res[-1]
        if occupied:  # as _first_block(0, limit), the common case inline
            start = (now + 1) % size
            later = occupied >> start or (occupied & ((1 << start) - 1)) << (size - start)
            event = limit = now + (later & -later).bit_length()
            if event < (now // size + 1) * size:  # before level 1's next block: no cascade
                return event
        for level in range(1, len(self._sizes)):
            block = self._first_block(level, limit)
            if block is not None:
                event = limit = block * self._res[level]
        return event

    def _cascade(self, tick: int) -> None:
        """At a block boundary: refile the ticks of the higher slots starting here."""
        for level in range(len(self._sizes) - 1, 0, -1):
            if tick % (res := self._res[level]) == 0:
                slots, slot = self._slots[level], tick // res % self._sizes[level]
                if ticks := slots[slot]:
                    slots[slot] = set()
                    self._occupied[level] &= ~(1 << slot)
                    self._file(ticks)

    def _compute_next_due(self) -> int | None:
        if self._overdue:
            return min(self._where[key][0] for key in self._overdue)
        while True:
            best = _NEVER
            for level in range(len(self._sizes)):
                block = self._first_block(level, min(best - 1, self._tick + self._res[-1]))
                if block is not None:
                    best = min(best, block if level == 0 else min(self._slots[level][block % self._sizes[level]]))
            if best == _NEVER or self._buckets[best]:
                return None if best == _NEVER else self._start + best * self._tick_ms
            del self._buckets[best]  # its keys were removed: it fires nothing
            self._unfile(best)

    def _round_up(self, due_ms: int) -> int:
        """``due_ms`` rounded up to the end of its tick."""
        return self._start - (self._start - due_ms) // self._tick_ms * self._tick_ms

    def _admit_time(self, due_ms: int) -> int:
        """A time after which ``horizon_ms >= due_ms`` (for ``due_ms`` > horizon)."""
        return due_ms - (self._res[-1] - 2) * self._tick_ms - 1


class TimingWheel(_Wheel[K]):
    """Hierarchical timing wheel; see the module docstring for the contract."""


class TriggerTimer(_Wheel[K]):
    """A TimingWheel for the near future backed by a DelayQueue for the rest (``add`` takes
    any time); a queued key moves into the wheel once the horizon reaches it."""

    def __len__(self) -> int:
        return len(self._where) + len(self._delayed)

    def __contains__(self, key: object) -> bool:
        return key in self._where or key in self._delayed

    @property
    def wheel_depth(self) -> int:
        return len(self._where)

    @property
    def delayed_depth(self) -> int:
        return len(self._delayed)

    def add(self, key: K, due_ms: int) -> None:
        """Schedule (or reschedule) ``key`` at any time, however far ahead."""
        self.remove(key)
        self._seq += 1
        if due_ms <= self.horizon_ms:
            self._insert(key, due_ms, self._seq)
        else:
            self._delayed._push(key, due_ms, self._seq)
            self._heed(due_ms)

    def add_earlier(self, key: K, due_ms: int) -> None:
        """Schedule ``key`` at ``due_ms`` unless it is already scheduled no later."""
        scheduled = self.due_ms(key)
        if scheduled is None or due_ms < scheduled:
            self.add(key, due_ms)

    def add_earlier_many(self, pairs: Iterable[tuple[K, int]]) -> None:
        """``add_earlier`` for each ``(key, due_ms)`` in turn: the timing loop's path.  A key
        not yet scheduled and due within the horizon (a preload's) takes no method call,
        and rows in due order share the last one's bucket lookup."""
        queued, seq, buckets, put = self._delayed._live, self._seq, self._buckets, self._where.setdefault
        start, tick_ms, now, horizon = self._start, self._tick_ms, self._now, self.horizon_ms
        last: int | None = None  # the due time of the last row taken
        tick, bucket = 0, {}
        new: list[int] = []  # ticks given their first key, filed in one call
        for key, due_ms in pairs:
            if due_ms != last and now < due_ms <= horizon:
                last, tick = due_ms, -((start - due_ms) // tick_ms)  # ceil division
                if (found := buckets.get(tick)) is None:
                    found = buckets[tick] = {}
                    new.append(tick)
                elif not found:  # emptied by cancels: the general path tells next_due_ms
                    last = None
                bucket = found
            entry = (due_ms, seq + 1, tick)
            if due_ms != last or queued and key in queued or put(key, entry) is not entry:
                if new and not buckets[new[-1]]:  # made for this row, and no key went in
                    del buckets[new.pop()]
                self._file(new)  # the general path, on a wheel in order
                new, last, self._seq = [], None, seq
                self.add_earlier(key, due_ms)
                seq = self._seq
                continue
            seq += 1
            bucket[key] = None
        self._file(new)
        self._seq = seq

    def due_ms(self, key: K) -> int | None:
        """The time ``key`` is scheduled for, or None if it is not."""
        entry = self._where.get(key) or self._delayed._live.get(key)
        return None if entry is None else entry[0]

    def _unqueue(self, key: K) -> bool:
        removed = self._delayed.remove(key)
        self._cache_ok = self._cache_ok and not removed
        return removed

    def _fire(self, now_ms: int) -> list[K]:
        fired: list[K] = []
        while True:
            for due_ms, seq, key in self._delayed._pop_entries(self.horizon_ms + 1):
                self._insert(key, due_ms, seq)  # the horizon reached it
            pending = self._delayed.peek_ms()
            if pending is None or pending > now_ms:
                break
            # Stop the wheel short of ``pending`` but close enough to admit it.
            fired += self._turn(max(self._now, min(now_ms, self._admit_time(pending))))
        fired += self._turn(max(self._now, now_ms))
        pending = self._delayed.peek_ms()
        if pending is not None:
            self._heed(pending)
            self._cache_ok = False
        return fired

    def _heed(self, due_ms: int) -> None:
        """A key waits in the queue until ``due_ms``: ``advance`` takes its slow path from the
        tick at which the horizon reaches it (or earlier), and ``next_due_ms`` knows of it."""
        admit = -((self._start - due_ms) // self._tick_ms) - self._res[-1] + 1
        self._event = min(self._event, admit)
        self._sooner(self._round_up(due_ms))

    def _compute_next_due(self) -> int | None:
        due, pending = super()._compute_next_due(), self._delayed.peek_ms()
        if pending is not None:
            due = self._round_up(pending) if due is None else min(due, self._round_up(pending))
        return due
