"""ax_kombu.core.cron: cron and interval schedules in epoch ms, DST, validation and the
misfire plan. Every time is an injected epoch-ms integer built from aware datetimes."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ax_kombu.core.cron import (
    MAX_EVERY_MS,
    MIN_EVERY_MS,
    MISFIRE_POLICIES,
    CronSchedule,
    IntervalSchedule,
    Plan,
    Schedule,
    every_ms,
    format_every,
    make_schedule,
    plan,
    to_datetime,
    upcoming,
    zone,
)
from ax_kombu.exceptions import ValidationError

SECOND = 1000
MINUTE = 60 * SECOND
HOUR = 60 * MINUTE
DAY = 24 * HOUR
BERLIN = "Europe/Berlin"
NEW_YORK = "America/New_York"


def ms(tz: str, year: int, month: int, day: int, hour: int = 0, minute: int = 0,
       second: int = 0, *, fold: int = 0) -> int:
    """A wall time in ``tz`` as epoch ms (``fold=1``: the second pass of a repeated hour)."""
    dt = datetime(year, month, day, hour, minute, second, tzinfo=ZoneInfo(tz), fold=fold)
    return round(dt.timestamp() * 1000)


def utc(year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0) -> int:
    return round(datetime(year, month, day, hour, minute, second,
                          tzinfo=UTC).timestamp() * 1000)


def wall(t_ms: int, tz: str) -> tuple[int, int, int, int, int, int]:
    """The local wall time of ``t_ms`` in ``tz`` (no offset: ambiguous on purpose)."""
    dt = datetime.fromtimestamp(t_ms / 1000, ZoneInfo(tz))
    return dt.year, dt.month, dt.day, dt.hour, dt.minute, dt.second


def between(schedule: Schedule, start_ms: int, end_ms: int) -> list[int]:
    """Occurrences in ``[start_ms, end_ms)``, chained through next_after from its own output."""
    out: list[int] = []
    t = schedule.next_after(start_ms - 1)
    while t is not None and t < end_ms:
        out.append(t)
        t = schedule.next_after(t)
    return out


def walk_back(schedule: Schedule, last: int, count: int) -> list[int]:
    """``count`` occurrences before ``last`` through last_before, oldest first."""
    out: list[int] = []
    t: int | None = last
    for _ in range(count):
        t = schedule.last_before(t) if t is not None else None
        assert t is not None
        out.append(t)
    return out[::-1]


class Finite:
    """A schedule with a fixed, finite list of occurrences (a schedule that ends)."""

    def __init__(self, times: list[int]) -> None:
        self.times = sorted(times)

    def next_after(self, t_ms: int) -> int | None:
        return next((t for t in self.times if t > t_ms), None)

    def last_before(self, t_ms: int) -> int | None:
        return next((t for t in reversed(self.times) if t < t_ms), None)

    def describe(self) -> str:
        return f"finite {self.times}"


def run(schedule: Schedule, next_fire_at: int, now: int, horizon: int, *,
        misfire: str = "fire_once", grace_ms: int | None = None, misfire_max: int = 100,
        on_time_ms: int = 0, pending: list[int] | None = None, limit: int = 1000) -> Plan:
    return plan(schedule, next_fire_at, now, horizon, misfire=misfire, grace_ms=grace_ms,
                misfire_max=misfire_max, on_time_ms=on_time_ms, pending=pending, limit=limit)


def scheduled(p: Plan) -> list[int]:
    return [s for s, _ in p.create]


# -- cron: strictly after / strictly before ------------------------------------------------------


def test_five_field_next_after_is_strictly_after() -> None:
    s = CronSchedule("0 9 * * *", "UTC")
    occ = utc(2026, 5, 5, 9)
    assert s.next_after(occ - 1) == occ
    assert s.next_after(occ - HOUR) == occ
    assert s.next_after(occ) == utc(2026, 5, 6, 9)
    assert s.next_after(occ + 1) == utc(2026, 5, 6, 9)


def test_five_field_last_before_is_strictly_before() -> None:
    s = CronSchedule("0 9 * * *", "UTC")
    occ = utc(2026, 5, 5, 9)
    assert s.last_before(occ) == utc(2026, 5, 4, 9)
    assert s.last_before(occ + 1) == occ
    assert s.last_before(occ + 30 * SECOND) == occ
    assert s.last_before(occ + HOUR) == occ


def test_five_field_expression_fires_on_whole_minutes_only() -> None:
    s = CronSchedule("* * * * *", "UTC")
    start = utc(2026, 5, 5, 12, 0, 30) + 500
    assert upcoming(s, start, 3) == [utc(2026, 5, 5, 12, m) for m in (1, 2, 3)]


def test_six_field_expression_has_seconds_first() -> None:
    s = CronSchedule("*/10 * * * * *", "UTC")
    occ = utc(2026, 5, 5, 9, 0, 0)
    assert s.next_after(occ - 1) == occ
    assert s.next_after(occ) == occ + 10 * SECOND
    assert s.next_after(occ + 999) == occ + 10 * SECOND
    assert s.last_before(occ) == occ - 10 * SECOND
    assert s.last_before(occ + 1) == occ
    assert upcoming(s, occ, 4) == [occ + k * 10 * SECOND for k in (1, 2, 3, 4)]


def test_six_field_fixed_second() -> None:
    s = CronSchedule("15 30 8 * * *", "UTC")
    assert s.next_after(utc(2026, 1, 1)) == utc(2026, 1, 1, 8, 30, 15)
    assert s.last_before(utc(2026, 1, 1)) == utc(2025, 12, 31, 8, 30, 15)


def test_cron_is_evaluated_in_its_time_zone() -> None:
    s = CronSchedule("0 8 * * *", "Asia/Shanghai")
    assert s.next_after(utc(2026, 5, 5)) == utc(2026, 5, 6, 0)
    assert wall(s.next_after(utc(2026, 5, 5)) or 0, "Asia/Shanghai") == (2026, 5, 6, 8, 0, 0)


def test_upcoming_lists_the_next_occurrences_in_order() -> None:
    s = CronSchedule("0 */6 * * *", "UTC")
    start = utc(2026, 5, 5, 7)
    assert upcoming(s, start, 4) == [utc(2026, 5, 5, 12), utc(2026, 5, 5, 18),
                                     utc(2026, 5, 6, 0), utc(2026, 5, 6, 6)]
    assert upcoming(s, start, 0) == []


def test_upcoming_is_strictly_after_an_occurrence() -> None:
    s = CronSchedule("0 */6 * * *", "UTC")
    assert upcoming(s, utc(2026, 5, 5, 12), 1) == [utc(2026, 5, 5, 18)]


def test_upcoming_stops_when_the_schedule_ends() -> None:
    assert upcoming(Finite([10, 20, 30]), 15, 5) == [20, 30]
    assert upcoming(Finite([10, 20, 30]), 30, 5) == []


@pytest.mark.parametrize(("alias", "fields"), [
    ("@yearly", "0 0 1 1 *"), ("@annually", "0 0 1 1 *"), ("@monthly", "0 0 1 * *"),
    ("@weekly", "0 0 * * 0"), ("@daily", "0 0 * * *"), ("@midnight", "0 0 * * *"),
    ("@hourly", "0 * * * *"), ("@DAILY", "0 0 * * *"),
])
def test_aliases_fire_like_their_expansion(alias: str, fields: str) -> None:
    start = ms(BERLIN, 2026, 3, 27, 13, 17)
    got = upcoming(CronSchedule(alias, BERLIN), start, 5)
    assert got == upcoming(CronSchedule(fields, BERLIN), start, 5)
    assert len(got) == 5


def test_daily_alias_is_local_midnight_and_hourly_is_every_hour() -> None:
    daily = upcoming(CronSchedule("@daily", "Asia/Shanghai"), utc(2026, 5, 5, 12), 2)
    assert [wall(t, "Asia/Shanghai")[3:] for t in daily] == [(0, 0, 0), (0, 0, 0)]
    assert daily[1] - daily[0] == DAY
    hourly = upcoming(CronSchedule("@hourly", "UTC"), utc(2026, 5, 5, 12, 30), 3)
    assert hourly == [utc(2026, 5, 5, 13), utc(2026, 5, 5, 14), utc(2026, 5, 5, 15)]


def test_whitespace_is_normalised() -> None:
    messy = CronSchedule("  0   9 *\t* *\n", BERLIN)
    assert messy.expr == "0 9 * * *"
    assert messy.describe() == "cron '0 9 * * *' Europe/Berlin"
    start = ms(BERLIN, 2026, 6, 1)
    assert upcoming(messy, start, 3) == upcoming(CronSchedule("0 9 * * *", BERLIN), start, 3)
    assert CronSchedule(" @daily ", "UTC").expr == "@daily"


@given(t=st.integers(utc(2020, 1, 1), utc(2030, 1, 1)),
       expr=st.sampled_from(["0 9 * * *", "*/20 * * * *", "*/10 * * * * *", "30 2 * * 1-5",
                             "0 0 1 * *", "@hourly", "5 4 29 2 *"]),
       tz=st.sampled_from(["UTC", "Asia/Shanghai", "Asia/Kolkata"]))
@settings(max_examples=150, deadline=None)
def test_cron_next_and_last_bracket_any_instant_in_a_zone_without_dst(
        t: int, expr: str, tz: str) -> None:
    s = CronSchedule(expr, tz)
    nxt, last = s.next_after(t), s.last_before(t)
    assert nxt is not None and last is not None
    assert last < t < nxt
    assert s.next_after(last) == s.next_after(t - 1)
    assert s.last_before(nxt) == s.last_before(t + 1)


# -- every / intervals ---------------------------------------------------------------------------


@pytest.mark.parametrize(("every", "expected"), [
    (1, 1000), (1.5, 1500), (90, 90_000), (2.25, 2250), (timedelta(minutes=5), 300_000),
    (timedelta(seconds=1), MIN_EVERY_MS), (3650 * 86_400, MAX_EVERY_MS),
    (timedelta(days=3650), MAX_EVERY_MS), (timedelta(hours=1, milliseconds=1), HOUR + 1),
])
def test_every_ms_accepts_seconds_and_timedeltas(every: object, expected: int) -> None:
    assert every_ms(every) == expected


@pytest.mark.parametrize(("every", "message"), [
    (True, "bool"), (False, "bool"), ("60", "str"), (None, "NoneType"), ([60], "list"),
    (float("nan"), "nan"),
    (0, "between 1 second and 3650 days"), (0.5, "between"), (-5, "between"),
    (0.999, "between"), (timedelta(milliseconds=500), "between"),
    (timedelta(seconds=-1), "between"), (3650 * 86_400 + 1, "between"),
    (timedelta(days=3651), "between"), (float("inf"), "between"), (float("-inf"), "between"),
    (10**30, "between"),
])
def test_every_ms_rejects_non_numbers_and_out_of_range(every: object, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        every_ms(every)


def test_interval_occurrences_are_anchor_plus_k_every_for_k_at_least_one() -> None:
    anchor = utc(2026, 5, 5, 12)
    s = IntervalSchedule(90 * SECOND, anchor)
    assert upcoming(s, anchor, 3) == [anchor + k * 90 * SECOND for k in (1, 2, 3)]
    assert s.next_after(anchor - 1) == anchor + 90 * SECOND
    assert s.next_after(anchor - 10 * DAY) == anchor + 90 * SECOND


def test_interval_next_after_is_strictly_after() -> None:
    s = IntervalSchedule(7 * SECOND, 123)
    occ = 123 + 5 * 7 * SECOND
    assert s.next_after(occ - 1) == occ
    assert s.next_after(occ) == occ + 7 * SECOND
    assert s.next_after(occ + 1) == occ + 7 * SECOND


def test_interval_last_before_is_strictly_before_and_never_the_anchor() -> None:
    s = IntervalSchedule(7 * SECOND, 123)
    first = 123 + 7 * SECOND
    assert s.last_before(first) is None
    assert s.last_before(123) is None
    assert s.last_before(first + 1) == first
    assert s.last_before(first + 7 * SECOND) == first
    assert s.last_before(first + 7 * SECOND + 1) == first + 7 * SECOND


@given(every=st.integers(MIN_EVERY_MS, 10 * DAY), anchor=st.integers(0, 2 * 10**12),
       offset=st.integers(-10**9, 10**10))
def test_interval_next_and_last_are_on_the_grid_and_adjacent(
        every: int, anchor: int, offset: int) -> None:
    s = IntervalSchedule(every, anchor)
    t = anchor + offset
    nxt = s.next_after(t)
    assert nxt is not None and nxt > t and (nxt - anchor) % every == 0 and nxt > anchor
    last = s.last_before(nxt)
    if last is not None:
        assert last == nxt - every and last <= t
        assert s.next_after(last) == nxt
    else:
        assert nxt == anchor + every


@pytest.mark.parametrize(("ms_", "text"), [
    (1000, "1s"), (90_000, "90s"), (60_000, "1m"), (5_400_000, "90m"), (3_600_000, "1h"),
    (7_200_000, "2h"), (86_400_000, "1d"), (90_000_000, "25h"), (1500, "1500ms"),
    (MAX_EVERY_MS, "3650d"),
])
def test_format_every(ms_: int, text: str) -> None:
    assert format_every(ms_) == text


def test_interval_describe_uses_format_every() -> None:
    assert IntervalSchedule(90_000, 0).describe() == "every 90s"


def test_make_schedule_builds_a_cron_or_an_interval() -> None:
    cron = make_schedule("0 9 * * *", None, BERLIN, 0)
    assert isinstance(cron, CronSchedule) and cron.tz == BERLIN
    interval = make_schedule(None, 5000, BERLIN, 42)
    assert isinstance(interval, IntervalSchedule)
    assert interval.next_after(0) == 5042


def test_to_datetime_is_aware_in_the_zone() -> None:
    t = ms(BERLIN, 2026, 7, 1, 9, 30)
    dt = to_datetime(t, BERLIN)
    assert dt == datetime(2026, 7, 1, 9, 30, tzinfo=ZoneInfo(BERLIN))
    assert (dt.hour, dt.utcoffset()) == (9, timedelta(hours=2))
    in_utc = to_datetime(t, "UTC")
    assert (in_utc.hour, in_utc.utcoffset()) == (7, timedelta(0))
    assert in_utc == dt


# -- DST -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("tz", "day", "expected_utc"), [
    (BERLIN, (2026, 3, 29), (2026, 3, 29, 1, 0)),
    (NEW_YORK, (2026, 3, 8), (2026, 3, 8, 7, 0)),
])
def test_wall_time_in_the_skipped_hour_fires_at_the_first_valid_instant_once(
        tz: str, day: tuple[int, int, int], expected_utc: tuple[int, ...]) -> None:
    s = CronSchedule("30 2 * * *", tz)
    got = upcoming(s, ms(tz, *day) - 1, 3)
    assert got[0] == utc(*expected_utc)
    assert wall(got[0], tz)[3:] == (3, 0, 0)
    assert [wall(t, tz)[:3] for t in got].count(day) == 1
    assert wall(got[1], tz)[3:5] == (2, 30)
    assert got[1] > got[0] + 12 * HOUR


@pytest.mark.parametrize(("tz", "day"), [(BERLIN, (2026, 3, 29)), (NEW_YORK, (2026, 3, 8))])
def test_skipped_hour_occurrence_is_found_from_anywhere_before_it(
        tz: str, day: tuple[int, int, int]) -> None:
    s = CronSchedule("30 2 * * *", tz)
    fire = ms(tz, *day, 3, 0)
    for t in (ms(tz, *day), ms(tz, *day, 1, 59), fire - MINUTE, fire - 1):
        assert s.next_after(t) == fire
    assert s.last_before(fire + 1) == fire
    assert s.last_before(fire + 10 * MINUTE) == fire


@pytest.mark.parametrize(("tz", "expr", "day", "first_utc", "next_utc"), [
    (BERLIN, "30 2 * * *", (2026, 10, 25), (2026, 10, 25, 0, 30), (2026, 10, 26, 1, 30)),
    (NEW_YORK, "30 1 * * *", (2026, 11, 1), (2026, 11, 1, 5, 30), (2026, 11, 2, 6, 30)),
])
def test_wall_time_in_the_repeated_hour_fires_once_in_the_first_pass(
        tz: str, expr: str, day: tuple[int, int, int], first_utc: tuple[int, ...],
        next_utc: tuple[int, ...]) -> None:
    s = CronSchedule(expr, tz)
    got = upcoming(s, ms(tz, *day) - 1, 2)
    assert got == [utc(*first_utc), utc(*next_utc)]
    assert got[0] == ms(tz, *day, *wall(got[0], tz)[3:5], fold=0)
    assert s.last_before(got[1]) == got[0]
    assert len(between(s, ms(tz, *day), ms(tz, *day) + 25 * HOUR)) == 1


@pytest.mark.parametrize(("tz", "day"), [(BERLIN, (2026, 10, 25)), (NEW_YORK, (2026, 11, 1))])
def test_wildcard_hour_keeps_its_cadence_through_both_passes_of_the_repeated_hour(
        tz: str, day: tuple[int, int, int]) -> None:
    s = CronSchedule("*/20 * * * *", tz)
    start, end = ms(tz, *day), ms(tz, *day, 5)
    got = between(s, start, end)
    assert {b - a for a, b in itertools.pairwise(got)} == {20 * MINUTE}
    assert len(got) == (end - start) // (20 * MINUTE)  # the 25-hour day has 3 extra
    repeated_hour = 2 if tz == BERLIN else 1
    walls = [wall(t, tz)[3:5] for t in got]
    assert walls.count((repeated_hour, 0)) == 2
    assert walls.count((repeated_hour, 20)) == 2
    assert walls.count((repeated_hour, 40)) == 2


@pytest.mark.parametrize(("tz", "day"), [(BERLIN, (2026, 3, 29)), (NEW_YORK, (2026, 3, 8))])
def test_wildcard_hour_keeps_its_cadence_across_the_skipped_hour(
        tz: str, day: tuple[int, int, int]) -> None:
    s = CronSchedule("*/20 * * * *", tz)
    got = between(s, ms(tz, *day), ms(tz, *day, 5))
    assert {b - a for a, b in itertools.pairwise(got)} == {20 * MINUTE}
    assert all(wall(t, tz)[3] != 2 for t in got)


@pytest.mark.parametrize(("tz", "expr", "start"), [
    (BERLIN, "30 2 * * *", (2026, 3, 20)), (BERLIN, "30 2 * * *", (2026, 10, 20)),
    (NEW_YORK, "30 2 * * *", (2026, 3, 1)), (NEW_YORK, "30 1 * * *", (2026, 10, 25)),
    (BERLIN, "*/20 * * * *", (2026, 10, 24, 22)), (NEW_YORK, "*/20 * * * *", (2026, 10, 31, 22)),
    (BERLIN, "*/20 * * * *", (2026, 3, 28, 22)), (NEW_YORK, "*/20 * * * *", (2026, 3, 7, 22)),
    (BERLIN, "0 */1 * * *", (2026, 10, 24, 20)), (BERLIN, "*/10 * * * * *", (2026, 10, 25, 1, 55)),
    (NEW_YORK, "0 0-3 * * *", (2026, 10, 30)), (BERLIN, "0 2 * * *", (2026, 3, 26)),
    (BERLIN, "@daily", (2026, 3, 26)),
])
def test_chained_occurrences_across_dst_increase_and_last_before_walks_back_the_same(
        tz: str, expr: str, start: tuple[int, ...]) -> None:
    s = CronSchedule(expr, tz)
    got = upcoming(s, ms(tz, *start), 60)
    assert len(got) == 60
    assert all(a < b for a, b in itertools.pairwise(got))
    assert walk_back(s, got[-1], 59) == got[:-1]
    assert all(s.next_after(t - 1) == t for t in got)
    assert all(s.last_before(t + 1) == t for t in got)


@pytest.mark.parametrize(("tz", "expr"), [
    (BERLIN, "*/20 * * * *"), (NEW_YORK, "*/20 * * * *"), (BERLIN, "*/10 * * * * *"),
    (BERLIN, "30 2 * * *"), (NEW_YORK, "30 2 * * *"),
])
def test_next_after_and_last_before_bracket_every_instant_across_spring_forward(
        tz: str, expr: str) -> None:
    s = CronSchedule(expr, tz)
    day = (2026, 3, 29) if tz == BERLIN else (2026, 3, 8)
    start = ms(tz, *day)
    for t in range(start, start + 6 * HOUR, 7 * MINUTE + 13):
        nxt, last = s.next_after(t), s.last_before(t)
        assert nxt is not None and last is not None
        assert last < t < nxt, (expr, tz, wall(t, tz))


@pytest.mark.parametrize(("tz", "expr"), [
    (BERLIN, "*/20 * * * *"), (NEW_YORK, "*/20 * * * *"), (BERLIN, "*/10 * * * * *"),
    (BERLIN, "0 */1 * * *"), (BERLIN, "*/20 2 * * *"),
])
def test_next_after_and_last_before_bracket_every_instant_across_fall_back_wildcards(
        tz: str, expr: str) -> None:
    s = CronSchedule(expr, tz)
    day = (2026, 10, 25) if tz == BERLIN else (2026, 11, 1)
    start = ms(tz, *day)
    for t in range(start, start + 6 * HOUR, 7 * MINUTE + 13):
        nxt, last = s.next_after(t), s.last_before(t)
        assert nxt is not None and last is not None
        assert last < t < nxt, (expr, tz, wall(t, tz))


# cronsim ignores fold=1 (it reads a wall time in the repeated hour as its first pass);
# CronSchedule._step corrects for it: these pin that correction.


@pytest.mark.parametrize(("tz", "expr", "day", "hour"), [
    (BERLIN, "30 2 * * *", (2026, 10, 25), 2), (NEW_YORK, "30 1 * * *", (2026, 11, 1), 1),
])
def test_fixed_wall_time_next_after_from_the_second_pass_of_the_repeated_hour(
        tz: str, expr: str, day: tuple[int, int, int], hour: int) -> None:
    s = CronSchedule(expr, tz)
    t = ms(tz, *day, hour, 10, fold=1)  # second pass, 20 min before the (already fired) :30
    fired = ms(tz, *day, hour, 30, fold=0)
    assert fired < t
    assert s.next_after(t) == ms(tz, day[0], day[1], day[2] + 1, hour, 30)
    assert s.last_before(t) == fired


def test_plan_from_the_second_pass_does_not_recreate_a_pending_repeated_hour_occurrence() -> None:
    s = CronSchedule("30 2 * * *", BERLIN)
    fired = ms(BERLIN, 2026, 10, 25, 2, 30)  # created earlier, never dispatched
    now = ms(BERLIN, 2026, 10, 25, 2, 10, fold=1)  # 40 real minutes later
    p = run(s, fired, now, now + HOUR, misfire="fire_once", pending=[fired])
    assert fired not in scheduled(p)  # kept (it is due) — not created a second time
    assert p.missed == 1


def test_plan_skip_from_the_second_pass_does_not_run_the_missed_occurrence() -> None:
    s = CronSchedule("30 2 * * *", BERLIN)
    missed = ms(BERLIN, 2026, 10, 25, 2, 30)
    now = ms(BERLIN, 2026, 10, 25, 2, 10, fold=1)
    p = run(s, missed, now, now + HOUR, misfire="skip", on_time_ms=SECOND)
    assert p.create == []
    assert p.missed == 1
    assert p.next_fire_at == ms(BERLIN, 2026, 10, 26, 2, 30)


# -- validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("expr", "message"), [
    ("61 * * * *", "bad cron expression '61 \\* \\* \\* \\*'.*minute"),
    ("* 25 * * *", "hour"),
    ("* * * *", "4 fields"),
    ("1 2 3 4 5 6 7", "7 fields"),
    ("@reboot", "1 fields"),
    ("", "non-empty"),
    ("   ", "non-empty"),
    ("0 0 30 2 *", "day-of-month"),
    ("0 " * 200, "at most 256"),
])
def test_bad_cron_expressions_are_refused_with_a_message_naming_the_problem(
        expr: str, message: str) -> None:
    with pytest.raises(ValidationError, match=f"(?i){message}"):
        CronSchedule(expr, "UTC")


@pytest.mark.parametrize("expr", [None, 5, b"0 9 * * *", ["0", "9", "*", "*", "*"]])
def test_non_string_cron_is_refused(expr: object) -> None:
    with pytest.raises(ValidationError, match="cron must be"):
        CronSchedule(expr, "UTC")  # type: ignore[arg-type]


@pytest.mark.parametrize("tz", ["Mars/Olympus", "../etc/passwd", "Europe/Berln"])
def test_unknown_zone_is_refused(tz: str) -> None:
    with pytest.raises(ValidationError, match="unknown time zone"):
        CronSchedule("0 9 * * *", tz)
    with pytest.raises(ValidationError, match="unknown time zone"):
        zone(tz)


@pytest.mark.parametrize("tz", [None, 5, b"UTC", "", "A" * 65])
def test_non_string_or_empty_zone_is_refused(tz: object) -> None:
    with pytest.raises(ValidationError, match="tz must be an IANA zone name"):
        zone(tz)


def test_zone_accepts_iana_names() -> None:
    assert zone(BERLIN) == ZoneInfo(BERLIN)
    assert zone("UTC") == ZoneInfo("UTC")


@pytest.mark.parametrize(("cron", "every"), [("0 9 * * *", 5000), (None, None)])
def test_make_schedule_needs_exactly_one_of_cron_or_every(
        cron: str | None, every: int | None) -> None:
    with pytest.raises(ValidationError, match="exactly one of cron"):
        make_schedule(cron, every, "UTC", 0)


def test_make_schedule_validates_the_zone_even_for_an_interval() -> None:
    with pytest.raises(ValidationError, match="unknown time zone 'Mars/Olympus'"):
        make_schedule(None, 5000, "Mars/Olympus", 0)
    with pytest.raises(ValidationError, match="unknown time zone"):
        make_schedule("0 9 * * *", None, "Mars/Olympus", 0)


def test_make_schedule_refuses_a_bad_expression() -> None:
    with pytest.raises(ValidationError, match="4 fields"):
        make_schedule("* * * *", None, "UTC", 0)


# -- plan: on time -------------------------------------------------------------------------------


def test_plan_on_time_creates_up_to_the_horizon_each_at_its_own_time() -> None:
    s = IntervalSchedule(1000, 0)
    p = run(s, 10_000, 10_000, 13_500)
    assert p.create == [(10_000, 10_000), (11_000, 11_000), (12_000, 12_000), (13_000, 13_000)]
    assert p.next_fire_at == 14_000
    assert (p.cancel, p.missed) == ([], 0)


def test_plan_includes_an_occurrence_exactly_at_the_horizon() -> None:
    p = run(IntervalSchedule(1000, 0), 10_000, 9_000, 12_000)
    assert scheduled(p) == [10_000, 11_000, 12_000]
    assert p.next_fire_at == 13_000


def test_plan_before_the_first_occurrence_and_beyond_the_horizon_creates_nothing() -> None:
    p = run(IntervalSchedule(1000, 0), 10_000, 5_000, 9_999)
    assert (p.create, p.next_fire_at, p.missed) == ([], 10_000, 0)


def test_plan_within_the_on_time_tolerance_is_not_a_misfire() -> None:
    p = run(IntervalSchedule(1000, 0), 9_000, 9_800, 10_500, misfire="skip", on_time_ms=1000,
            pending=[8_000])
    assert p.create == [(9_000, 9_000), (10_000, 10_000)]
    assert (p.cancel, p.missed) == ([], 0)


def test_two_consecutive_passes_never_create_an_occurrence_twice() -> None:
    s = IntervalSchedule(1000, 0)
    first = run(s, 1_000, 1_000, 5_000)
    assert first.next_fire_at is not None
    second = run(s, first.next_fire_at, 3_000, 7_000)
    both = scheduled(first) + scheduled(second)
    assert both == list(range(1_000, 7_001, 1000))
    assert first.missed == second.missed == 0


def test_an_occurrence_exactly_now_is_due_not_missed() -> None:
    p = run(IntervalSchedule(1000, 0), 5_000, 20_000, 20_000, misfire="skip")
    assert p.create == [(20_000, 20_000)]
    assert p.missed == 15


# -- plan: misfire policies ----------------------------------------------------------------------


def test_fire_once_runs_only_the_latest_missed_occurrence_now() -> None:
    p = run(IntervalSchedule(1000, 0), 5_000, 20_500, 22_000, misfire="fire_once")
    assert p.create == [(20_000, 20_500), (21_000, 21_000), (22_000, 22_000)]
    assert p.missed == len(range(5_000, 20_001, 1000))
    assert p.cancel == []
    assert p.next_fire_at == 23_000


def test_fire_once_cancels_pending_missed_occurrences() -> None:
    p = run(IntervalSchedule(1000, 0), 5_000, 20_500, 21_000, misfire="fire_once",
            pending=[4_000, 3_000])
    assert p.create == [(20_000, 20_500), (21_000, 21_000)]
    assert p.cancel == [3_000, 4_000]
    assert p.missed == len(range(3_000, 20_001, 1000))


def test_fire_once_keeps_the_latest_when_it_is_already_pending() -> None:
    # occurrences created by a pass whose next_fire_at was never saved: still pending
    p = run(IntervalSchedule(1000, 0), 5_000, 20_500, 21_000, misfire="fire_once",
            pending=[18_000, 19_000, 20_000])
    assert 20_000 not in scheduled(p)
    assert p.create == [(21_000, 21_000)]
    assert p.cancel == [18_000, 19_000]
    assert p.next_fire_at == 22_000


def test_fire_once_keeps_a_pending_latest_when_next_fire_at_is_off_the_grid() -> None:
    p = run(IntervalSchedule(1000, 0), 5_500, 5_900, 6_000, misfire="fire_once",
            pending=[4_000, 5_000])
    assert p.create == [(6_000, 6_000)]
    assert p.cancel == [4_000]


def test_pending_occurrences_not_yet_due_are_never_cancelled() -> None:
    p = run(IntervalSchedule(1000, 0), 5_000, 20_500, 22_000, misfire="skip",
            pending=[3_000, 21_000])
    assert p.cancel == [3_000]


def test_skip_runs_nothing_cancels_all_pending_and_resumes_at_the_next_future_occurrence() -> None:
    p = run(IntervalSchedule(1000, 0), 5_000, 20_500, 22_000, misfire="skip",
            pending=[3_000, 4_000])
    assert p.create == [(21_000, 21_000), (22_000, 22_000)]
    assert p.cancel == [3_000, 4_000]
    assert p.next_fire_at == 23_000
    assert p.missed == len(range(3_000, 20_001, 1000))


def test_fire_all_runs_every_missed_occurrence_now_oldest_first() -> None:
    p = run(IntervalSchedule(1000, 0), 5_000, 9_500, 11_000, misfire="fire_all")
    # catch-ups trigger at the pass, 1 ms apart in occurrence order: dispatched oldest first
    assert p.create == [(5_000, 9_500), (6_000, 9_501), (7_000, 9_502), (8_000, 9_503),
                        (9_000, 9_504), (10_000, 10_000), (11_000, 11_000)]
    assert p.missed == 5
    assert p.cancel == []


def test_fire_all_runs_pending_missed_occurrences_as_catch_ups_first() -> None:
    p = run(IntervalSchedule(1000, 0), 5_000, 8_500, 8_500, misfire="fire_all",
            pending=[4_000, 3_000])
    # the written ones are kept and move to the pass, before the fresh ones (oldest first)
    assert p.retrigger == [(3_000, 8_500), (4_000, 8_501)]
    assert p.create == [(5_000, 8_502), (6_000, 8_503), (7_000, 8_504), (8_000, 8_505)]
    assert p.cancel == []
    assert p.missed == 6


def test_fire_all_is_capped_at_misfire_max_keeping_the_latest() -> None:
    p = run(IntervalSchedule(1000, 0), 1_000, 50_500, 50_500, misfire="fire_all", misfire_max=3,
            pending=[500])
    assert p.create == [(48_000, 50_500), (49_000, 50_501), (50_000, 50_502)]
    assert p.cancel == [500]
    assert 3 < p.missed <= 51
    assert p.next_fire_at == 51_000


def test_fire_all_cap_cancels_older_pending_but_keeps_pending_among_the_latest() -> None:
    p = run(IntervalSchedule(1000, 0), 1_000, 10_500, 10_500, misfire="fire_all", misfire_max=3,
            pending=[2_000, 8_000, 9_000, 10_000])
    assert p.create == []
    assert p.retrigger == [(8_000, 10_500), (9_000, 10_501), (10_000, 10_502)]
    assert p.cancel == [2_000]


# -- plan: grace ---------------------------------------------------------------------------------


def test_fire_once_drops_the_catch_up_when_it_is_older_than_the_grace() -> None:
    s = IntervalSchedule(1000, 0)
    late = run(s, 5_000, 20_500, 20_500, misfire="fire_once", grace_ms=300, pending=[4_000])
    assert late.create == []
    assert late.cancel == [4_000]
    assert late.missed == len(range(4_000, 20_001, 1000))
    in_grace = run(s, 5_000, 20_500, 20_500, misfire="fire_once", grace_ms=600)
    assert in_grace.create == [(20_000, 20_500)]


def test_fire_all_runs_only_the_missed_occurrences_within_the_grace() -> None:
    p = run(IntervalSchedule(1000, 0), 5_000, 20_500, 20_500, misfire="fire_all",
            grace_ms=2_500, pending=[3_000])
    assert p.create == [(18_000, 20_500), (19_000, 20_501), (20_000, 20_502)]
    assert p.cancel == [3_000]


def test_grace_boundary_is_inclusive() -> None:
    p = run(IntervalSchedule(1000, 0), 5_000, 20_500, 20_500, misfire="fire_once", grace_ms=500)
    assert p.create == [(20_000, 20_500)]


def test_no_grace_catches_up_even_after_thirty_days_down() -> None:
    s = CronSchedule("0 9 * * *", BERLIN)
    first = ms(BERLIN, 2026, 4, 1, 9)
    now = ms(BERLIN, 2026, 5, 1, 11)
    p = run(s, first, now, now + HOUR, misfire="fire_once", grace_ms=None)
    assert p.create == [(ms(BERLIN, 2026, 5, 1, 9), now)]
    assert p.missed == len(between(s, first, now))
    assert p.next_fire_at == ms(BERLIN, 2026, 5, 2, 9)


# -- plan: limit, DST, end -----------------------------------------------------------------------


def test_limit_caps_the_creates_and_the_next_pass_continues_without_a_gap() -> None:
    s = IntervalSchedule(1000, 0)
    first = run(s, 1_000, 1_000, 100_000, limit=3)
    assert scheduled(first) == [1_000, 2_000, 3_000]
    assert first.next_fire_at == 4_000
    second = run(s, first.next_fire_at, 1_000, 100_000, limit=3)
    assert scheduled(second) == [4_000, 5_000, 6_000]


def test_limit_counts_the_catch_up() -> None:
    p = run(IntervalSchedule(1000, 0), 5_000, 20_500, 100_000, misfire="fire_once", limit=2)
    assert p.create == [(20_000, 20_500), (21_000, 21_000)]
    assert p.next_fire_at == 22_000


def test_plan_catch_up_over_spring_forward_is_the_skipped_hour_fire() -> None:
    s = CronSchedule("30 2 * * *", BERLIN)
    nfa = ms(BERLIN, 2026, 3, 28, 2, 30)
    now = ms(BERLIN, 2026, 3, 29, 12)
    p = run(s, nfa, now, now + HOUR, misfire="fire_once")
    assert p.create == [(ms(BERLIN, 2026, 3, 29, 3, 0), now)]
    assert p.missed == 2
    assert p.next_fire_at == ms(BERLIN, 2026, 3, 30, 2, 30)


def test_plan_fire_all_over_fall_back_runs_each_pass_of_the_repeated_hour_once() -> None:
    s = CronSchedule("*/20 * * * *", BERLIN)
    nfa = ms(BERLIN, 2026, 10, 25, 1, 40)
    now = ms(BERLIN, 2026, 10, 25, 3, 5)
    p = run(s, nfa, now, now, misfire="fire_all")
    assert scheduled(p) == between(s, nfa, now)
    assert len(scheduled(p)) == len(set(scheduled(p))) == (now - nfa) // (20 * MINUTE) + 1
    assert [trigger for _, trigger in p.create] == [now + i for i in range(len(p.create))]


@pytest.mark.parametrize(("tz", "expr", "day"), [
    (BERLIN, "*/20 * * * *", (2026, 10, 25)), (NEW_YORK, "*/20 * * * *", (2026, 11, 1)),
    (BERLIN, "30 2 * * *", (2026, 10, 25)), (BERLIN, "30 2 * * *", (2026, 3, 29)),
    (NEW_YORK, "30 1 * * *", (2026, 11, 1)), (NEW_YORK, "*/20 * * * *", (2026, 3, 8)),
])
def test_on_time_passes_across_dst_create_every_occurrence_once(
        tz: str, expr: str, day: tuple[int, int, int]) -> None:
    s = CronSchedule(expr, tz)
    start = ms(tz, *day) - DAY
    nfa: int | None = s.next_after(start)
    created: list[int] = []
    now = horizon = start
    while now < start + 3 * DAY:
        assert nfa is not None
        horizon = now + 15 * MINUTE
        p = run(s, nfa, now, horizon, misfire="fire_all", on_time_ms=SECOND)
        assert p.missed == 0 and p.cancel == []
        assert all(sched == trig for sched, trig in p.create)
        created += scheduled(p)
        nfa = p.next_fire_at
        now += 10 * MINUTE
    assert created == between(s, start + 1, horizon + 1)


def test_plan_of_a_schedule_that_ends_has_no_next_fire_at() -> None:
    s = Finite([1_000, 2_000, 3_000])
    p = run(s, 1_000, 1_000, 10_000)
    assert scheduled(p) == [1_000, 2_000, 3_000]
    assert p.next_fire_at is None


def test_plan_behind_a_schedule_that_ended_catches_up_and_ends() -> None:
    s = Finite([1_000, 2_000, 3_000])
    p = run(s, 2_000, 10_000, 20_000, misfire="fire_once")
    assert p.create == [(3_000, 10_000)]
    assert p.next_fire_at is None
    assert p.missed == 2


# -- plan: properties ----------------------------------------------------------------------------


@given(every=st.integers(MIN_EVERY_MS, 600_000), anchor=st.integers(0, 10**12),
       lookahead_k=st.floats(0, 20), on_time_ms=st.integers(0, 5_000),
       misfire=st.sampled_from(MISFIRE_POLICIES),
       grace_ms=st.none() | st.integers(0, 3_000_000), misfire_max=st.integers(1, 20),
       gaps=st.lists(st.integers(1, 10_000_000), min_size=1, max_size=25))
@settings(max_examples=300, deadline=None)
def test_repeated_passes_never_create_the_same_occurrence_twice(
        every: int, anchor: int, lookahead_k: float, on_time_ms: int, misfire: str,
        grace_ms: int | None, misfire_max: int, gaps: list[int]) -> None:
    s = IntervalSchedule(every, anchor)
    lookahead = int(lookahead_k * every)
    nfa: int | None = s.next_after(anchor)
    now = anchor
    created: dict[int, int] = {}  # scheduled_at -> trigger_time
    cancelled: set[int] = set()
    for gap in gaps:
        assert nfa is not None
        prev, now = now, now + gap
        # not dispatched: came due during the gap (pessimistically: the scheduler was down)
        pending = [t for t, trig in created.items() if prev < trig < now and t not in cancelled]
        p = run(s, nfa, now, now + lookahead, misfire=misfire, grace_ms=grace_ms,
                misfire_max=misfire_max, on_time_ms=on_time_ms, pending=pending)
        for sched, trig in p.create:
            assert sched not in created
            assert (sched - anchor) % every == 0 and sched > anchor
            assert trig == sched if sched >= now - on_time_ms else now <= trig <= now + 2 * misfire_max
            created[sched] = trig
        assert set(p.cancel) <= set(pending)
        cancelled |= set(p.cancel)
        assert p.next_fire_at is not None and p.next_fire_at > now + lookahead
        assert p.next_fire_at > max(created, default=p.next_fire_at - 1)
        nfa = p.next_fire_at


@given(every=st.integers(MIN_EVERY_MS, 600_000), anchor=st.integers(0, 10**12),
       lookahead=st.integers(1, 3_000_000), misfire=st.sampled_from(MISFIRE_POLICIES),
       first_pass_back=st.integers(0, 3_000_000),
       gap_fractions=st.lists(st.floats(0.0001, 1.0), min_size=1, max_size=40))
@settings(max_examples=300, deadline=None)
def test_passes_without_downtime_create_every_occurrence_exactly_once(
        every: int, anchor: int, lookahead: int, misfire: str, first_pass_back: int,
        gap_fractions: list[float]) -> None:
    s = IntervalSchedule(every, anchor)
    first = s.next_after(anchor)
    assert first is not None
    nfa: int | None = first
    now = first - first_pass_back
    created: list[int] = []
    for i, fraction in enumerate([0.0, *gap_fractions]):
        if i:
            now += max(1, int(fraction * lookahead))  # at most one horizon between passes
        assert nfa is not None
        p = run(s, nfa, now, now + lookahead, misfire=misfire, grace_ms=0, misfire_max=1,
                on_time_ms=0, pending=[], limit=lookahead // every + 1)
        assert p.missed == 0 and p.cancel == []
        assert all(sched == trig for sched, trig in p.create)
        created += scheduled(p)
        nfa = p.next_fire_at
    expected = list(range(first, now + lookahead + 1, every))
    assert created == expected
