"""The timing loop's firing (:mod:`ax_kombu.scheduler.timing`) on a clock the test moves: the
claim lead, the claim window, and solo ids that fire at their own time."""

from __future__ import annotations

from typing import Any, cast

import pytest

from ax_kombu.config import Settings, from_env
from ax_kombu.scheduler.loop import Mailbox
from ax_kombu.scheduler.timing import TimingLoop
from ax_kombu.store.clock import DbClock

T = 1_800_000_000_000  # the test's epoch (database ms)


class Clock:
    """A database clock whose local reading the test sets."""

    def __init__(self) -> None:
        self.now = float(T)

    def local_ms(self) -> float:
        return self.now


def make(lead_ms: int, window_ms: int) -> tuple[TimingLoop, Clock, Mailbox[int]]:
    settings: Settings = from_env({}, database_url="sqlite://", claim_lead_ms=lead_ms,
                                  claim_window_ms=window_ms)
    clock, fired = Clock(), Mailbox[int]()
    loop = TimingLoop(settings, cast(DbClock, clock), fired)
    loop.start_at(T)
    cast(Any, loop)._sleep = lambda now: None  # the test moves the clock, nothing waits
    return loop, clock, fired


def fire_at(loop: TimingLoop, clock: Clock, at: int, fired: Mailbox[int]) -> list[int]:
    """One pass of the loop at ``T + at``: the ids it fired."""
    clock.now = T + at
    loop.run_once()
    out = list(fired.items)
    fired.items.clear()
    return out


def test_the_next_ids_within_the_window_fire_with_the_one_that_reaches_its_lead() -> None:
    loop, clock, fired = make(lead_ms=250, window_ms=20)
    loop.hand([(1, T + 300), (2, T + 310), (3, T + 320), (4, T + 321), (5, T + 345)])
    assert fire_at(loop, clock, 0, fired) == []
    assert fire_at(loop, clock, 49, fired) == []  # the first is 251 ms away: not yet
    assert fire_at(loop, clock, 50, fired) == [1, 2, 3]  # 1 at its lead, 2 and 3 within 20 ms
    assert fire_at(loop, clock, 60, fired) == []  # 4 is 261 ms away: it waits for its lead
    loop.hand([(6, T + 322)])  # a wake-up for ids handed over fires nothing early
    assert fire_at(loop, clock, 70, fired) == []
    assert fire_at(loop, clock, 71, fired) == [4, 6]  # 5 (345) is 24 ms after 4: not with it
    assert fire_at(loop, clock, 95, fired) == [5]


@pytest.mark.parametrize(("lead_ms", "window_ms"), [(250, 0), (0, 20)])
def test_without_a_window_or_without_a_lead_each_id_fires_at_its_own_lead(
        lead_ms: int, window_ms: int) -> None:
    loop, clock, fired = make(lead_ms, window_ms)
    loop.hand([(1, T + 300), (2, T + 301), (3, T + 310)])
    assert fire_at(loop, clock, 300 - lead_ms, fired) == [1]
    assert fire_at(loop, clock, 301 - lead_ms, fired) == [2]
    assert fire_at(loop, clock, 309 - lead_ms, fired) == []
    assert fire_at(loop, clock, 310 - lead_ms, fired) == [3]


def test_a_solo_id_fires_at_its_own_time_never_with_a_window_before_it() -> None:
    """What the claim skipped as not due yet (a runner with a fixed lead) is handed back
    solo: a window that reaches it early leaves it out, and it fires at its own time, once,
    even if it is handed over again meanwhile (a preload's copy)."""
    loop, clock, fired = make(lead_ms=250, window_ms=20)
    loop.hand_solo([(7, T + 305)])
    loop.hand([(1, T + 300), (2, T + 310)])
    assert fire_at(loop, clock, 50, fired) == [1, 2]  # 7 is within the window: left out
    loop.hand([(7, T + 305)])  # handed over again, not solo this time
    assert fire_at(loop, clock, 54, fired) == []
    assert fire_at(loop, clock, 55, fired) == [7]
    assert fire_at(loop, clock, 80, fired) == []  # once
    loop.hand([(8, T + 400)])
    assert fire_at(loop, clock, 150, fired) == [8]  # an id handed later is not solo
