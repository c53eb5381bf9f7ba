"""Producer-side validation: every ``enqueue`` field bounded, and the row it becomes.

Contract: :func:`build_row` either returns a row every column of the store
accepts, or raises :class:`~ax_kombu.exceptions.ValidationError` naming the
field — never a database error later. Text fields are bounded by type, length
and valid Unicode (no NUL), numbers by type and range (``bool`` is not an
int), the trigger time by how far ahead it is, and the payload by JSON
(string keys, no NaN or Infinity, 64-bit integers), size, depth and value
count. :func:`canonical_json` and :func:`fingerprint` give the duplicate check
its key.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import uuid
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

from ax_kombu.config import PRIORITIES, Settings, redact_url
from ax_kombu.core.ids import EPOCH_MS
from ax_kombu.core.states import Status
from ax_kombu.exceptions import ValidationError
from ax_kombu.store.schema import CELERY_RUNNERS

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
#: deepest nesting of lists/objects in a payload, and most values (containers and scalars) in
#: it: within what a worker accepts in a message (ax_kombu.broker.rejects: 64 levels for the
#: whole body, 100,000 values), so an accepted task can never be refused on its way
MAX_PAYLOAD_DEPTH = 32
MAX_PAYLOAD_VALUES = 100_000
#: integers in a payload: 64-bit, so every JSON decoder (orjson included) reads them back exactly
_INT_RANGE = (-(1 << 63), (1 << 64) - 1)
_TRACE_ID = re.compile(r"[A-Za-z0-9._:-]+")


def _check_payload(payload: Any) -> None:
    """Refuse what JSON would change or a worker refuse: nesting deeper than
    ``MAX_PAYLOAD_DEPTH``, more than ``MAX_PAYLOAD_VALUES`` values, non-string keys,
    integers beyond 64 bits, text that is not valid Unicode."""
    stack: list[tuple[Any, int]] = [(payload, 0)]
    count = 0
    while stack:
        value, depth = stack.pop()
        count += 1
        if count > MAX_PAYLOAD_VALUES:
            raise ValidationError(f"payload holds more than {MAX_PAYLOAD_VALUES} values")
        if isinstance(value, str):
            _utf8("payload", value)
        elif isinstance(value, bool) or value is None or isinstance(value, float):
            continue  # NaN/Infinity: json.dumps(allow_nan=False) refuses them
        elif isinstance(value, int):
            if not _INT_RANGE[0] <= value <= _INT_RANGE[1]:
                raise ValidationError("payload holds an integer beyond 64 bits; "
                                      "pass it as a string")
        elif isinstance(value, (Mapping, list, tuple)):
            if depth >= MAX_PAYLOAD_DEPTH:
                raise ValidationError(f"payload is nested deeper than {MAX_PAYLOAD_DEPTH} "
                                      "levels")
            if isinstance(value, Mapping):
                for key in value:
                    if not isinstance(key, str):
                        raise ValidationError("payload keys must be strings, got "
                                              f"{type(key).__name__}")
                    _utf8("payload", key)
                stack.extend((item, depth + 1) for item in value.values())
            else:
                stack.extend((item, depth + 1) for item in value)
        # anything else: json.dumps says whether it is serialisable


def canonical_json(payload: Any, limit: int) -> str:
    """The payload as compact JSON with sorted keys (so key order never matters).

    Raises:
        ValidationError: not JSON-serialisable, NaN/Infinity, non-string keys, integers
            beyond 64 bits, nested deeper than ``MAX_PAYLOAD_DEPTH``, or over ``limit``
            bytes.
    """
    _check_payload(payload)
    try:
        text = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                          allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise ValidationError(f"payload is not JSON-serialisable: {exc}") from None
    size = len(text.encode())
    if size > limit:
        raise ValidationError(f"payload is {size} bytes encoded; the limit is {limit} "
                              "(AX_MAX_PAYLOAD_BYTES)")
    return text


def fingerprint(task_type: str, payload_json: str) -> str:
    """128-bit hex digest of the task type and canonical payload."""
    return hashlib.blake2b(f"{task_type}\0{payload_json}".encode(), digest_size=16).hexdigest()


def show(value: Any) -> str:
    """``repr(value)`` cut to 80 characters, for error messages (even for a huge int)."""
    try:
        return repr(value)[:80]
    except ValueError:  # an int too long to print
        return f"<{type(value).__name__}>"


def _as_int(name: str, value: Any, minimum: int, maximum: int) -> int:
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
    at = now_ms + round(_delay_s(delay) * 1000)
    if at > latest:
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


def _utf8(name: str, value: str) -> None:
    try:
        value.encode()
    except UnicodeEncodeError:
        raise ValidationError(f"{name} is not valid Unicode (a lone surrogate)") from None
    if "\x00" in value and name != "payload":
        raise ValidationError(f"{name} contains a NUL character")


def _callback(url: Any) -> str:
    if not isinstance(url, str):
        raise ValidationError(f"callback_url must be a string, got {type(url).__name__}")
    if len(url) > MAX_CALLBACK_URL:
        raise ValidationError(f"callback_url is longer than {MAX_CALLBACK_URL} characters")
    _utf8("callback_url", url)
    shown = redact_url(url)[:200]
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in url):
        raise ValidationError(f"callback_url {shown!r} contains whitespace or control characters")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a malformed port
    except ValueError as exc:
        raise ValidationError(f"callback_url {shown!r} is malformed: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValidationError(f"callback_url must be an http(s) URL with a host, got {shown!r}")
    return url


def is_celery_name(processor: object) -> bool:
    """True when ``processor`` has the form of a Celery route (``celery:…``, ``celery+…``,
    in any case), which only :mod:`ax_kombu.celery` may write (:func:`check_route`)."""
    return isinstance(processor, str) and processor[:7].lower() in ("celery:", "celery+")


def _runner(processor_name: str | None, callback: str | None, runner: str | None) -> str:
    """The row's ``runner`` (:data:`ax_kombu.store.schema.RUNNERS`): ``runner`` if given
    (a Celery one needs a ``celery:<queue>`` processor), else by the target."""
    if runner is None:
        return "callback" if callback is not None else "ax"
    if runner not in CELERY_RUNNERS:
        raise ValidationError(f"runner must be one of {', '.join(CELERY_RUNNERS)}, "
                              f"got {show(runner)}")
    if processor_name is None or not is_celery_name(processor_name) \
            or not processor_name.partition(":")[2]:
        raise ValidationError(f"a Celery-bound task needs processor 'celery:<queue>', got "
                              f"{show(processor_name)}")
    return runner


def check_route(row: Mapping[str, Any]) -> None:
    """Refuse a row of :func:`ax_kombu.enqueue` whose processor name (``processor=``, or the
    task type by default) has the form of a Celery route: where a task runs is its stored
    ``runner``, never a name, and only :mod:`ax_kombu.celery` routes to Celery.

    Raises:
        ValidationError: such a name on a row that is not Celery-bound.
    """
    name = row.get("processor_name")
    if row.get("runner") in CELERY_RUNNERS or not is_celery_name(name):
        return
    raise ValidationError(
        f"processor {show(name)} looks like a Celery route ('celery:' or 'celery+' prefix); "
        "ax.enqueue runs a task on an ax processor or callback only. Send a Celery task "
        "with ax_kombu.celery (ax.celery.enqueue(app, name, ...) or the installed "
        "apply_async), or choose a processor name without that prefix")


def _target(task_type: str, processor: Any, callback_url: Any) -> tuple[str | None, str | None]:
    if processor is not None and callback_url is not None:
        raise ValidationError("give processor or callback_url, not both")
    if callback_url is not None:
        return None, _callback(callback_url)
    if processor is None:
        return task_type, None
    return _text("processor", processor, MAX_PROCESSOR), None


def check_text(name: str, value: Any, limit: int) -> str:
    """A non-empty string of at most ``limit`` characters of valid Unicode.

    Raises:
        ValidationError: anything else.
    """
    return _text(name, value, limit)


def _text(name: str, value: Any, limit: int) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValidationError(f"{name} must be a non-empty string, got {show(value)}")
    if len(value) > limit:
        raise ValidationError(f"{name} is longer than {limit} characters")
    _utf8(name, value)
    return str(value)


def _trace_id(value: Any) -> str:
    if value is None:
        return uuid.uuid4().hex
    text = _text("trace_id", value, MAX_TRACE_ID)
    if not _TRACE_ID.fullmatch(text):
        raise ValidationError(f"trace_id may hold only letters, digits and . _ : -, "
                              f"got {text!r}")
    return text


def _priority(priority: Any) -> None:
    if not isinstance(priority, str) or priority not in PRIORITIES:
        raise ValidationError(f"unknown priority {show(priority)}; use one of "
                              f"{', '.join(PRIORITIES)}")


#: what a failed task that will retry does to its order key (see ax_kombu.core.gating)
ORDER_POLICIES = {"hold_failed": "order", "skip_failed": "order_skip"}
MAX_ORDER_KEY = 255
#: most shards one enqueue makes
MAX_SHARDS = 1024


def _order(order_key: Any, order_policy: Any) -> tuple[str | None, str | None]:
    """``(order_key, gate)`` of a task."""
    if order_policy not in ORDER_POLICIES:
        raise ValidationError(f"unknown order_policy {show(order_policy)}; use one of "
                              f"{', '.join(ORDER_POLICIES)}")
    if order_key is None:
        return None, None
    return _text("order_key", order_key, MAX_ORDER_KEY), ORDER_POLICIES[order_policy]


def shard_count(shards: Any) -> int | str | None:
    """``shards`` as a number of shards, or ``"workers"`` (None: not sharded).

    Raises:
        ValidationError: not an int within 1..MAX_SHARDS, nor ``"workers"``.
    """
    if shards is None or shards == "workers":
        return shards  # type: ignore[no-any-return]
    if isinstance(shards, str):
        raise ValidationError(f"shards must be an int within 1..{MAX_SHARDS} or \"workers\", "
                              f"got {show(shards)}")
    return _as_int("shards", shards, 1, MAX_SHARDS)


def broadcast_row(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` as a ``shards="workers"`` task: one row now, one shard per live worker of its
    queue made when a scheduler claims it (:mod:`ax_kombu.store.gates`).

    Raises:
        ValidationError: combined with an order key (a broadcast is not ordered).
    """
    if row.get("order_key") is not None:
        raise ValidationError("shards=\"workers\" cannot be combined with order_key")
    return dict(row, gate="workers")


def shard_rows(row: dict[str, Any], count: int) -> list[dict[str, Any]]:
    """``row`` as ``count`` shards: each with its index, its own fingerprint (shards of one
    task are not duplicates of each other) and its own biz_key (``key#i``)."""
    biz_key = row.get("biz_key")
    if biz_key is not None and len(biz_key) + len(f"#{count - 1}") > MAX_BIZ_KEY:
        raise ValidationError(f"biz_key is too long for {count} shards (each gets '#<index>'; "
                              f"at most {MAX_BIZ_KEY} characters in all)")
    out = []
    for index in range(count):
        shard = dict(row, shard_index=index, shard_total=count,
                     fingerprint=fingerprint(f"{row['task_type']}\0shard{index}/{count}",
                                             row["payload"]))
        if biz_key is not None:
            shard["biz_key"] = f"{biz_key}#{index}"
        out.append(shard)
    return out


def build_row(settings: Settings, now_ms: int, task_type: Any, payload: Any, *,
              run_at: datetime | None = None, delay: Any = None, priority: str = "default",
              biz_key: str | None = None, max_retry: int | None = None,
              timeout_ms: int | None = None, processor: str | None = None,
              callback_url: str | None = None, trace_id: str | None = None,
              order_key: str | None = None, order_policy: str = "hold_failed",
              runner: str | None = None) -> dict[str, Any]:
    """Validate one task and return its row (without ``task_id``).

    Every field is bounded (see the ``MAX_*`` constants above): text fields by
    type, length and valid Unicode, numbers by type and range, the trigger time
    by how far ahead it is, the payload by JSON, size and depth.

    ``runner``: a Celery runner, from :mod:`ax_kombu.celery` only (None: ``'callback'``
    with a ``callback_url``, else ``'ax'``; see :func:`check_route`).

    Raises:
        ValidationError: any argument is invalid.
    """
    task_type = _text("task_type", task_type, MAX_TASK_TYPE)
    _priority(priority)
    if biz_key is not None:
        biz_key = _text("biz_key", biz_key, MAX_BIZ_KEY)
    processor_name, callback = _target(task_type, processor, callback_url)
    payload_json = canonical_json(payload, settings.max_payload_bytes)
    key, gate = _order(order_key, order_policy)
    trigger = trigger_ms(now_ms, run_at, delay)
    return {
        "task_type": task_type,
        "trigger_time": trigger,
        "order_key": key, "order_seq": trigger if key is not None else None, "gate": gate,
        "status": initial_status(trigger, now_ms),
        "priority": str(priority),
        "retry_count": 0,
        "max_retry": _as_int("max_retry", settings.default_max_retry if max_retry is None
                             else max_retry, 0, MAX_RETRY),
        "timeout_ms": _as_int("timeout_ms", settings.default_timeout_ms if timeout_ms is None
                              else timeout_ms, 1, MAX_TIMEOUT_MS),
        "processor_name": processor_name,
        "callback_url": callback,
        "runner": _runner(processor_name, callback, runner),
        "payload": payload_json,
        "biz_key": biz_key,
        "fingerprint": fingerprint(task_type, payload_json),
        "trace_id": _trace_id(trace_id),
        "attempt": 0,
        "created_at": now_ms,
    }
