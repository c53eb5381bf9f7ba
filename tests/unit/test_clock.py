from __future__ import annotations

from ax_kombu.store.clock import DbClock, estimate_offset


def test_offset_comes_from_the_fastest_round_trip() -> None:
    samples = [(1000.0, 1530, 1040.0), (2000.0, 2505, 2010.0), (3000.0, 3600, 3100.0)]
    offset, rtt = estimate_offset(samples)
    assert (offset, rtt) == (500.0, 10.0)


def test_clock_reads_local_time_plus_offset() -> None:
    wall = [10_000.0]
    clock = DbClock(lambda: int(wall[0]) + 250, wall_ms=lambda: wall[0], refresh_s=3600)
    assert clock.now_ms() == 10_250
    wall[0] += 40
    assert clock.now_ms() == 10_290 and clock.offset_ms == 250
