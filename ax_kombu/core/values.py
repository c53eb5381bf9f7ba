"""The checks of single values a producer writes, pure: bounds, text, integers, the
trigger time, a new task's first status.

Each check returns the value as it is to be stored, or raises
:class:`~ax_kombu.exceptions.ValidationError` naming the field: never a database error
later. Text is bounded by type, length and valid Unicode (no NUL), integers by type and
range (``bool`` is not an int), the trigger time by how far ahead it is. Shared by the
producer API (:mod:`ax_kombu.validation`, :mod:`ax_kombu.recurring`) and the scheduler's
recurring jobs (:mod:`ax_kombu.scheduler.recurrence`).
"""

from __future__ import annotations

import math
import re
import uuid
from datetime import datetime, timedelta
from typing import Any

from ax_kombu.core.errors import ValidationError
from ax_kombu.core.ids import EPOCH_MS
from ax_kombu.core.states import Status

#: Bounds of each enqueue field. Lengths match the columns in :mod:`ax_kombu.store.schema`.
MAX_TASK_TYPE = 128
MAX_PROCESSOR = 255
MAX_CALLBACK_URL = 2048
MAX_BIZ_KEY = 255
MAX_TRACE_ID = 32
#: retries after a failure; the backoff is capped, so more would only keep a task alive for ever
MAX_RETRY = 1000
#: one run's timeout: 7 days (the column is a 32-bit INTEGER)
MAX_TIMEOUT_MS = 7 * 86_400_000
#: how far ahead a task may be scheduled: 10 years (365-day)
MAX_HORIZON_MS = 3650 * 86_400_000
#: the last millisecond a snowflake id (41 bits of ms after its epoch) can express, ~2093
LAST_MS = EPOCH_MS + (1 << 41) - 1
#: what a recurring job does when an occurrence falls due while an earlier one is unfinished
STRATEGIES = ("parallel", "serial", "cover", "discard")
_TRACE_ID = re.compile(r"[A-Za-z0-9._:-]+")


def show(value: Any) -> str:
    """``repr(value)`` cut to 80 characters, for error messages (even for a huge int)."""
    try:
        return repr(value)[:80]
    except ValueError:  # an int too long to print
        return f"<{type(value).__name__}>"


def as_int(name: str, value: Any, minimum: int, maximum: int) -> int:
    """``value`` as an int within ``minimum..maximum`` (a bool is not one)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValidationError(f"{name} must be an integer, got {show(value)}")
    if not minimum <= value <= maximum:
        raise ValidationError(f"{name} must be within {minimum}..{maximum}, got {show(value)}")
    return int(value)


def initial_status(trigger: int, now_ms: int) -> str:
    """A new task's state: DELAYED while its trigger time is ahead, READY once due (a
    label for ``ax inspect``: the preload and the claim treat both alike)."""
    return (Status.DELAYED if trigger > now_ms else Status.READY).value


def trigger_ms(now_ms: int, run_at: datetime | None, delay: Any) -> int:
    """The trigger time in epoch ms from exactly one of ``run_at`` / ``delay`` (or now).

    ``run_at`` must be a timezone-aware datetime: a naive one is ambiguous and
    refused; one in the past means now. ``delay`` is seconds (int/float) or a
    timedelta, never negative. Either may reach at most ``MAX_HORIZON_MS`` ahead
    (and no later than the snowflake ids can count, ~2093).
    """
    if run_at is not None and delay is not None:
        raise ValidationError("give run_at or delay, not both")
    latest = min(now_ms + MAX_HORIZON_MS, LAST_MS)
    if run_at is not None:
        return _run_at_ms(run_at, latest)
    if delay is None:
        return now_ms
    ms = _delay_s(delay) * 1000  # a finite delay may still overflow here (1e308 s)
    if not math.isfinite(ms) or (at := now_ms + round(ms)) > latest:
        raise ValidationError(f"delay {show(delay)} is too far ahead: at most "
                              f"{MAX_HORIZON_MS // 86_400_000} days")
    return at


def _run_at_ms(run_at: Any, latest: int) -> int:
    if not isinstance(run_at, datetime):
        raise ValidationError(f"run_at must be a datetime, got {type(run_at).__name__}")
    try:
        offset = run_at.utcoffset()
    except (TypeError, ValueError, OverflowError) as exc:  # a tzinfo that fails
        raise ValidationError(f"run_at has an unusable tzinfo: {exc}") from None
    if offset is None:
        raise ValidationError("run_at is a naive datetime; pass an aware one, e.g. "
                              "datetime(2026, 12, 24, 20, 0, tzinfo=timezone.utc)")
    try:
        at = round(run_at.timestamp() * 1000)
    except (OverflowError, ValueError, OSError) as exc:
        raise ValidationError(f"run_at is out of range: {exc}") from None
    if not 0 <= at <= latest:
        raise ValidationError(f"run_at {run_at.isoformat()} is out of range: from 1970 up "
                              f"to {MAX_HORIZON_MS // 86_400_000} days ahead")
    return at


def _delay_s(delay: Any) -> float:
    if isinstance(delay, timedelta):
        seconds = delay.total_seconds()
    elif isinstance(delay, (int, float)) and not isinstance(delay, bool):
        if isinstance(delay, int) and not -1 <= delay <= MAX_HORIZON_MS // 1000:
            seconds = -1.0 if delay < 0 else math.inf  # too large for a float: out of range
        else:
            seconds = float(delay)
    else:
        raise ValidationError(f"delay must be seconds or a timedelta, got {show(delay)}")
    if not math.isfinite(seconds) or seconds < 0:
        raise ValidationError(f"delay must be a finite number >= 0, got {show(delay)}")
    return seconds


def check_utf8(name: str, value: str) -> None:
    """Refuse text that is not valid Unicode (a lone surrogate), or, but in a payload,
    holds a NUL character."""
    try:
        value.encode()
    except UnicodeEncodeError:
        raise ValidationError(f"{name} is not valid Unicode (a lone surrogate)") from None
    if "\x00" in value and name != "payload":
        raise ValidationError(f"{name} contains a NUL character")


def check_text(name: str, value: Any, limit: int) -> str:
    """A non-empty string of at most ``limit`` characters of valid Unicode.

    Raises:
        ValidationError: anything else.
    """
    if not isinstance(value, str) or not value.strip():
        raise ValidationError(f"{name} must be a non-empty string, got {show(value)}")
    if len(value) > limit:
        raise ValidationError(f"{name} is longer than {limit} characters")
    check_utf8(name, value)
    return str(value)


def check_trace_id(value: Any) -> str:
    """``value`` as a trace id of ``[A-Za-z0-9._:-]``, or a new one for None."""
    if value is None:
        return uuid.uuid4().hex
    text = check_text("trace_id", value, MAX_TRACE_ID)
    if not _TRACE_ID.fullmatch(text):
        raise ValidationError(f"trace_id may hold only letters, digits and . _ : -, "
                              f"got {text!r}")
    return text
