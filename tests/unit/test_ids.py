from __future__ import annotations

import threading

import pytest

from ax_kombu.core.ids import (
    EPOCH_MS,
    MAX_NODE,
    MAX_SEQUENCE,
    NODE_BITS,
    SEQUENCE_BITS,
    ReservedIds,
    Snowflake,
    compose,
)


def decompose(task_id: int) -> tuple[int, int, int]:
    """``(epoch_ms, node, sequence)`` of ``task_id``: the layout the module docstring gives."""
    return ((task_id >> (NODE_BITS + SEQUENCE_BITS)) + EPOCH_MS,
            (task_id >> SEQUENCE_BITS) & MAX_NODE, task_id & MAX_SEQUENCE)


class Clock:
    def __init__(self, ms: int) -> None:
        self.ms = ms

    def __call__(self) -> int:
        return self.ms


def test_compose_round_trips_and_stays_positive() -> None:
    ms = EPOCH_MS + (1 << 41) - 1
    task_id = compose(ms, 1023, MAX_SEQUENCE)
    assert 0 < task_id < 1 << 63
    assert decompose(task_id) == (ms, 1023, MAX_SEQUENCE)


def test_ids_are_time_ordered() -> None:
    clock = Clock(EPOCH_MS + 1000)
    gen = Snowflake(7, clock)
    first = gen.next_ids(10)
    clock.ms += 1
    (later,) = gen.next_ids(1)
    assert first == sorted(first) and len(set(first)) == 10
    assert later > first[-1]
    assert decompose(later)[0] == clock.ms


def test_clock_stepping_backwards_never_repeats_or_goes_down() -> None:
    clock = Clock(EPOCH_MS + 10_000)
    gen = Snowflake(3, clock)
    before = gen.next_ids(5)
    clock.ms -= 5_000  # NTP step back
    after = gen.next_ids(5)
    assert after[0] > before[-1]
    assert len(set(before + after)) == 10


def test_sequence_exhaustion_borrows_the_next_millisecond() -> None:
    clock = Clock(EPOCH_MS + 5)
    ids = Snowflake(1, clock).next_ids(MAX_SEQUENCE + 3)
    assert len(set(ids)) == len(ids) and ids == sorted(ids)
    assert decompose(ids[-1])[0] == clock.ms + 1


def test_threads_never_collide() -> None:
    gen = Snowflake(9, lambda: EPOCH_MS + 1)  # frozen clock: maximum contention
    out: list[list[int]] = [[] for _ in range(4)]
    threads = [threading.Thread(target=lambda i=i: out[i].extend(gen.next_ids(3000)))
               for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    every = [x for chunk in out for x in chunk]
    assert len(set(every)) == 12_000


def test_bad_node_is_refused() -> None:
    with pytest.raises(ValueError):
        Snowflake(1024, lambda: EPOCH_MS)


class FakeReserver:
    """Reservations in a dict, with the same contract as the store's reserver."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.reserved: dict[int, tuple[str, int]] = {}

    def acquire(self, owner: str, reservation_ms: int) -> tuple[int, int]:
        for slot in range(1024):
            taken = self.reserved.get(slot)
            if taken is None or taken[1] < self.clock.ms:
                self.reserved[slot] = (owner, self.clock.ms + reservation_ms)
                return slot, self.clock.ms + reservation_ms
        raise AssertionError("exhausted")

    def renew(self, slot: int, owner: str, reservation_ms: int) -> int | None:
        taken = self.reserved.get(slot)
        if taken is None or taken[0] != owner or taken[1] <= self.clock.ms:
            return None
        self.reserved[slot] = (owner, self.clock.ms + reservation_ms)
        return self.clock.ms + reservation_ms

    def release(self, slot: int, owner: str) -> None:
        self.reserved.pop(slot, None)


def test_a_reservation_is_renewed_before_it_runs_out_and_replaced_when_lost() -> None:
    clock = Clock(EPOCH_MS + 1_000)
    reserver = FakeReserver(clock)
    ids = ReservedIds(reserver, "a", 9_000, clock)
    ids.next_ids(1)
    assert ids.slot == 0
    clock.ms += 6_500  # less than a third left: renewed, same slot
    ids.next_ids(1)
    assert ids.slot == 0 and reserver.reserved[0][1] == clock.ms + 9_000
    clock.ms += 20_000  # the reservation ran out while idle; another process takes slot 0
    other = ReservedIds(reserver, "b", 9_000, clock)
    other.next_ids(1)
    assert other.slot == 0
    ids.next_ids(1)
    assert ids.slot == 1  # never issues under a slot it no longer has
