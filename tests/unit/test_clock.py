from __future__ import annotations

import pytest

from ax_kombu.store.clock import DbClock, estimate_offset


class Host:
    """A fake host: a monotonic clock, a wall clock that can step, and a database clock."""

    def __init__(self, wall: float = 10_000.0, db_ahead: float = 250.0) -> None:
        self.mono = 5_000.0
        self.wall = wall
        self.db_ahead = db_ahead
        self.db_reads = 0

    def advance(self, ms: float) -> None:
        self.mono += ms
        self.wall += ms

    def db(self) -> int:
        self.db_reads += 1
        return int(self.mono + 5_000.0 + self.db_ahead)  # the database's clock never steps

    def clock(self, refresh_s: float = 3600) -> DbClock:
        return DbClock(self.db, mono_ms=lambda: self.mono, wall_ms=lambda: self.wall,
                       refresh_s=refresh_s)


def test_offset_comes_from_the_fastest_round_trip() -> None:
    samples = [(1000.0, 1530, 1040.0), (2000.0, 2505, 2010.0), (3000.0, 3600, 3100.0)]
    offset, rtt = estimate_offset(samples)
    assert (offset, rtt) == (500.0, 10.0)


def test_clock_reads_monotonic_time_plus_the_measured_base() -> None:
    host = Host()
    clock = host.clock()
    assert clock.now_ms() == 10_250 and clock.offset_ms == 250
    host.advance(40)
    assert clock.now_ms() == 10_290 and clock.local_ms() == 10_290
    assert host.db_reads == 3  # measured once, then read locally


def test_the_earliest_reading_is_less_the_half_round_trip() -> None:
    """A hold until a time on the database clock must not end before it however the
    round trip was split: the earliest reading takes the whole uncertainty off."""
    mono = [1000.0]

    def db() -> int:  # the query takes 40 ms; the database read its clock somewhere in it
        mono[0] += 40.0
        return 1530

    clock = DbClock(db, mono_ms=lambda: mono[0], wall_ms=lambda: mono[0], samples=1)
    clock.sync()
    assert clock.round_trip_ms == 40.0
    assert clock.local_ms() == 1040.0 + 510.0           # the midpoint estimate
    assert clock.earliest_ms() == 1040.0 + 510.0 - 20.0  # 1530 may have been read at 1040


@pytest.mark.parametrize("step_ms", [10_000.0, -10_000.0])
def test_a_wall_clock_step_moves_neither_now_nor_local_time(step_ms: float) -> None:
    host = Host()
    clock = host.clock()
    clock.now_ms()
    host.advance(100)
    host.wall += step_ms  # an NTP step: the monotonic clock and the database do not move
    assert clock.local_ms() == 10_350
    reads = host.db_reads
    assert clock.now_ms() == 10_350
    assert clock.steps == 1 and host.db_reads > reads  # noticed, and measured again at once
    assert clock.offset_ms == pytest.approx(250 - step_ms)  # the skew is reported
    assert clock.now_ms() == 10_350 and clock.steps == 1  # noticed once


def test_a_failed_re_measurement_keeps_the_last_base() -> None:
    host = Host()
    clock = host.clock(refresh_s=1)
    clock.now_ms()
    host.advance(2_000)

    def down() -> int:
        raise ConnectionError("database restarting")

    clock._read_db_ms = down
    assert clock.now_ms() == 12_250


def test_the_first_measurement_failure_propagates() -> None:
    def down() -> int:
        raise ConnectionError("no database")

    with pytest.raises(ConnectionError):
        DbClock(down).now_ms()
