"""When a recurring job fires: cron expressions and fixed intervals in a time zone, and the
misfire plan after downtime — pure, no I/O, no clock (every time is passed in, as epoch ms).

Cron expressions are parsed and evaluated by `cronsim <https://pypi.org/project/cronsim/>`_
(it follows Debian's cron, DST included); this module only adapts it to epoch milliseconds
and validates input. Five fields (minute hour day-of-month month day-of-week) or six with
seconds first; ``@yearly``/``@annually``, ``@monthly``, ``@weekly``, ``@daily``/``@midnight``
and ``@hourly`` are accepted as the usual shorthands.

Daylight saving time, as cron users expect (Vixie/Debian cron):

* **Clocks go back** (the repeated hour): a job at a fixed wall time (``30 2 * * *``) fires
  once, in the first pass of that hour. A job whose hour field is a wildcard or a step
  (``*/20 * * * *``) keeps its cadence through both passes, as it does every other hour.
* **Clocks go forward** (the skipped hour): a wall time that does not exist that day fires at
  the first valid instant after it (``30 2 * * *`` at 03:00 in Europe/Berlin on the last
  Sunday of March); it is never silently skipped.

Intervals (``every``) are wall-clock independent: ``anchor + k·every`` for k ≥ 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Protocol
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

from ax_kombu.core.errors import ValidationError

#: the misfire policies; the first is the default
MISFIRE_POLICIES = ("fire_once", "skip", "fire_all")
#: shortest interval: the scheduler's cron resolution is one second
MIN_EVERY_MS = 1000
#: longest interval: 10 years, as far ahead as a task may be scheduled
MAX_EVERY_MS = 3650 * 86_400_000
MAX_CRON = 256
MAX_TZ = 64
_ALIASES = {"@yearly": "0 0 1 1 *", "@annually": "0 0 1 1 *", "@monthly": "0 0 1 * *",
            "@weekly": "0 0 * * 0", "@daily": "0 0 * * *", "@midnight": "0 0 * * *",
            "@hourly": "0 * * * *"}


class Schedule(Protocol):
    """When a job's occurrences fall, as epoch milliseconds."""

    def next_after(self, t_ms: int) -> int | None:
        """The first occurrence strictly after ``t_ms`` (None: there is none)."""

    def last_before(self, t_ms: int) -> int | None:
        """The last occurrence strictly before ``t_ms`` (None: there is none)."""

    def describe(self) -> str:
        """The schedule as a user wrote it (``cron '0 8 * * *' Asia/Shanghai``)."""


def zone(name: object) -> ZoneInfo:
    """The IANA time zone ``name``.

    Raises:
        ValidationError: not a string, or no such zone.
    """
    if not isinstance(name, str) or not name or len(name) > MAX_TZ:
        raise ValidationError(f"tz must be an IANA zone name such as 'Europe/Berlin', "
                              f"got {name!r}"[:200])
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValidationError(f"unknown time zone {name!r} (use an IANA name such as "
                              "'Europe/Berlin' or 'UTC')") from None


class CronSchedule:
    """A cron expression evaluated in an IANA time zone."""

    def __init__(self, expr: str, tz: str = "UTC") -> None:
        if not isinstance(expr, str) or not expr.strip() or len(expr) > MAX_CRON:
            raise ValidationError(f"cron must be a non-empty expression of at most {MAX_CRON} "
                                  f"characters, got {expr!r}"[:200])
        self.expr = " ".join(expr.split())
        self.tz = tz
        self._zone = zone(tz)
        self._fields = _ALIASES.get(self.expr.lower(), self.expr)
        if len(self._fields.split()) not in (5, 6):
            raise ValidationError(f"bad cron expression {self.expr!r}: it has "
                                  f"{len(self._fields.split())} fields; use 5 (minute hour "
                                  "day month weekday) or 6 (seconds first)")
        try:
            CronSim(self._fields, datetime(2000, 1, 1, tzinfo=self._zone))
        except CronSimError as exc:
            raise ValidationError(f"bad cron expression {self.expr!r}: {exc}") from None

    def _step(self, t_ms: int, reverse: bool) -> int | None:
        """The first occurrence after (``reverse``: before) ``t_ms``, strictly.

        cronsim reads a wall time in a repeated hour as its first pass (it ignores
        ``fold``): from an instant in the second pass it would answer an occurrence of the
        first pass, already behind us. Forward, such answers are stepped over; backward,
        the search starts past the repeated hour and walks back to ``t_ms``.
        """
        start = datetime.fromtimestamp(t_ms / 1000.0, self._zone)
        if reverse and start.fold:
            start = datetime.fromtimestamp(t_ms / 1000.0 + 3600, self._zone)
        for found in CronSim(self._fields, start, reverse=reverse):
            at = round(found.timestamp() * 1000)
            if (at < t_ms) if reverse else (at > t_ms):
                return at
        return None  # nothing within cronsim's 50-year search

    def next_after(self, t_ms: int) -> int | None:
        return self._step(t_ms, reverse=False)

    def last_before(self, t_ms: int) -> int | None:
        return self._step(t_ms, reverse=True)

    def describe(self) -> str:
        return f"cron {self.expr!r} {self.tz}"


class IntervalSchedule:
    """Every ``every_ms`` from ``anchor_ms``: occurrences at ``anchor + k·every``, k ≥ 1."""

    def __init__(self, every_ms: int, anchor_ms: int) -> None:
        self.every_ms = every_ms
        self.anchor_ms = anchor_ms

    def next_after(self, t_ms: int) -> int | None:
        if t_ms < self.anchor_ms + self.every_ms:
            return self.anchor_ms + self.every_ms
        return self.anchor_ms + ((t_ms - self.anchor_ms) // self.every_ms + 1) * self.every_ms

    def last_before(self, t_ms: int) -> int | None:
        k = (t_ms - 1 - self.anchor_ms) // self.every_ms
        return self.anchor_ms + k * self.every_ms if k >= 1 else None

    def describe(self) -> str:
        return f"every {format_every(self.every_ms)}"


def every_ms(every: object) -> int:
    """``every`` (seconds as int/float, or a timedelta) in milliseconds.

    Raises:
        ValidationError: not a number of seconds, or outside 1 s .. 10 years.
    """
    if isinstance(every, timedelta):
        ms = round(every.total_seconds() * 1000)
        shown = str(every)
    elif isinstance(every, (int, float)) and not isinstance(every, bool):
        if math.isnan(every):
            raise ValidationError("every must be a number of seconds or a timedelta, got nan")
        ms = round(float(every) * 1000) if abs(every) < 1e15 else MAX_EVERY_MS + 1
        shown = f"{every!r} s"
    else:
        raise ValidationError("every must be a number of seconds or a timedelta, got "
                              f"{type(every).__name__}")
    if not MIN_EVERY_MS <= ms <= MAX_EVERY_MS:
        raise ValidationError(f"every must be between 1 second and 3650 days, got {shown}")
    return ms


def format_every(ms: int) -> str:
    """``90000`` → ``"90s"``; whole minutes/hours/days shown as such."""
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms"


def make_schedule(cron: str | None, every: int | None, tz: str, anchor_ms: int) -> Schedule:
    """The schedule of a job: exactly one of ``cron`` or ``every`` (ms) is given.

    Raises:
        ValidationError: both or neither, a bad expression, an unknown zone.
    """
    if (cron is None) == (every is None):
        raise ValidationError("give exactly one of cron=… or every=…")
    if cron is not None:
        return CronSchedule(cron, tz)
    zone(tz)  # validated even though an interval does not use it
    assert every is not None
    return IntervalSchedule(every, anchor_ms)


def upcoming(schedule: Schedule, after_ms: int, count: int) -> list[int]:
    """The next ``count`` occurrences strictly after ``after_ms`` (fewer if the schedule ends)."""
    out: list[int] = []
    t = schedule.next_after(after_ms)
    while t is not None and len(out) < count:
        out.append(t)
        t = schedule.next_after(t)
    return out


def to_datetime(t_ms: int, tz: str) -> datetime:
    """Epoch ms as an aware datetime in ``tz``."""
    return datetime.fromtimestamp(t_ms / 1000.0, ZoneInfo(tz))


# -- the plan: what one pass of the materialiser does for one job --------------------------------


@dataclass
class Plan:
    """What to write for one job in one pass.

    Attributes:
        create: ``(scheduled_at, trigger_time)`` of each task to create, in order.
        retrigger: ``(scheduled_at, trigger_time)`` of missed occurrences already in the
            store that run as catch-ups: their trigger time moves to the pass.
        cancel: occurrences already in the store, not started and missed, to cancel.
        next_fire_at: the first occurrence not yet created (None: the schedule ended).
        missed: how many occurrences were missed (at least; counting stops past
            ``misfire_max``); 0 when the job was on time.
    """

    create: list[tuple[int, int]] = field(default_factory=list)
    retrigger: list[tuple[int, int]] = field(default_factory=list)
    cancel: list[int] = field(default_factory=list)
    next_fire_at: int | None = None
    missed: int = 0


def plan(schedule: Schedule, next_fire_at: int, now_ms: int, horizon_ms: int, *,
         misfire: str, grace_ms: int | None, misfire_max: int, on_time_ms: int,
         pending: list[int] | None = None, limit: int = 1000) -> Plan:
    """Plan one pass for a job whose first uncreated occurrence is ``next_fire_at``.

    Occurrences up to ``horizon_ms`` are created ahead, each to trigger at its own time.
    When the job is behind — ``next_fire_at`` more than ``on_time_ms`` in the past: no
    scheduler ran, or the job was paused — every occurrence before that cutoff was
    **missed**: those never created, and those in ``pending`` (created earlier, not yet
    dispatched; only looked up when the job is behind). Missed occurrences older than ``grace_ms``
    (None: no limit) are dropped; the rest go by ``misfire``:

    * ``fire_once``: the latest one runs now, once; the others are dropped.
    * ``skip``: none runs; the job resumes at its next future occurrence.
    * ``fire_all``: each runs now, oldest first — at most ``misfire_max``, the latest ones.

    Catch-up runs trigger at ``now_ms``, 1 ms apart in occurrence order (so they are
    dispatched oldest first, and ``trigger_time != scheduled_at`` tells them apart); a
    missed occurrence in ``pending`` that runs is listed in ``retrigger``, one that is
    dropped in ``cancel``. An occurrence due less than ``on_time_ms`` ago is not missed:
    it runs as usual.
    """
    cutoff = now_ms - on_time_ms
    result = Plan()
    pending = sorted(p for p in (pending or []) if p < cutoff) if next_fire_at < cutoff else []
    start: int | None = next_fire_at
    if next_fire_at < cutoff:
        start = _first_at_or_after(schedule, cutoff)
        missed = _missed(schedule, next_fire_at, cutoff, misfire_max)
        keep, result.missed = _misfire(misfire, sorted(set(missed) | set(pending)),
                                       now_ms - grace_ms if grace_ms is not None else None,
                                       misfire_max)
        result.cancel = [p for p in pending if p not in keep]
        kept = set(pending)
        for i, at in enumerate(sorted(keep)):
            (result.retrigger if at in kept else result.create).append((at, now_ms + i))
    t = start
    while t is not None and t <= horizon_ms and len(result.create) < limit:
        result.create.append((t, t))
        t = schedule.next_after(t)
    result.next_fire_at = t
    return result


def _first_at_or_after(schedule: Schedule, t_ms: int) -> int | None:
    return schedule.next_after(t_ms - 1)


def _missed(schedule: Schedule, first: int, cutoff: int, misfire_max: int) -> list[int]:
    """The latest missed occurrences in ``[first, cutoff)``, newest first: at most
    ``misfire_max + 1``, so that "more than the cap" shows in the count."""
    out: list[int] = []
    t = schedule.last_before(cutoff)
    while t is not None and t >= first and len(out) <= misfire_max:
        out.append(t)
        t = schedule.last_before(t)
    return out


def _misfire(policy: str, missed: list[int], oldest_allowed: int | None,
             misfire_max: int) -> tuple[list[int], int]:
    """Which missed occurrences (sorted, oldest first) to run; and how many were missed."""
    count = len(missed)
    if oldest_allowed is not None:
        missed = [t for t in missed if t >= oldest_allowed]
    if policy == "skip" or not missed:
        return [], count
    if policy == "fire_once":
        return missed[-1:], count
    return missed[-misfire_max:], count
