"""The producer side: validate a task, protect against duplicates, hand it to the store.

Guarantees of :meth:`Client.enqueue` / :meth:`Client.enqueue_many`:

* Bad input raises :class:`ValidationError` and writes nothing; a batch is
  validated whole before anything is written.
* A call that returns has committed its task(s): a crash after it loses
  nothing.
* ``biz_key``: the same ``(task_type, biz_key)`` enqueued again returns the
  existing id and creates nothing.
* Fingerprint: a task with the same type and payload (key order does not
  matter) whose trigger time is less than ``dedup_window_ms`` from a
  non-cancelled one is not created again; the existing id comes back with
  ``created=False``.
Both hold across concurrent producers in many processes (see
:mod:`ax_kombu.store.tasks`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import socket
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Self
from urllib.parse import urlsplit

from ax_kombu.config import PRIORITIES, Settings, redact_url
from ax_kombu.core import states
from ax_kombu.core.ids import EPOCH_MS, LeasedIds
from ax_kombu.core.states import Status
from ax_kombu.exceptions import IllegalTransition, TaskNotFound, ValidationError
from ax_kombu.store import Store, transitions
from ax_kombu.store.leases import StoreLessor
from ax_kombu.store.tasks import fetch_task, insert_tasks

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

_TASK_ARGS = frozenset({"task_type", "payload", "run_at", "delay", "priority", "biz_key",
                        "max_retry", "timeout_ms", "processor", "callback_url", "trace_id"})


class TaskId(int):
    """A task id (an ``int``) that also says whether this call created the task."""

    created: bool

    def __new__(cls, value: int, created: bool = True) -> Self:
        obj = super().__new__(cls, value)
        obj.created = created
        return obj

    @property
    def duplicate(self) -> bool:
        """True when the call matched an existing task and created nothing."""
        return not self.created


@dataclass(frozen=True)
class TaskView:
    """A read-only snapshot of one task row."""

    task_id: int
    task_type: str
    status: Status
    trigger_time: int
    priority: str
    payload: Any
    retry_count: int
    max_retry: int
    timeout_ms: int
    processor_name: str | None
    callback_url: str | None
    biz_key: str | None
    fingerprint: str
    trace_id: str
    attempt: int
    last_run_node: str | None
    created_at: int
    dispatched_at: int | None
    started_at: int | None
    finished_at: int | None
    last_error: str | None

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> TaskView:
        data = {k: row[k] for k in cls.__dataclass_fields__}
        data["status"] = Status(row["status"])
        data["payload"] = json.loads(row["payload"])
        return cls(**data)


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


def _show(value: Any) -> str:
    """``repr(value)`` cut to 80 characters, for error messages (even for a huge int)."""
    try:
        return repr(value)[:80]
    except ValueError:  # an int too long to print
        return f"<{type(value).__name__}>"


def _as_int(name: str, value: Any, minimum: int, maximum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValidationError(f"{name} must be an integer, got {_show(value)}")
    if not minimum <= value <= maximum:
        raise ValidationError(f"{name} must be within {minimum}..{maximum}, got {_show(value)}")
    return int(value)


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
    if delay is None:
        return now_ms
    if isinstance(delay, timedelta):
        seconds = delay.total_seconds()
    elif isinstance(delay, (int, float)) and not isinstance(delay, bool):
        if isinstance(delay, int) and not -1 <= delay <= MAX_HORIZON_MS // 1000:
            seconds = -1.0 if delay < 0 else math.inf  # too large for a float: out of range
        else:
            seconds = float(delay)
    else:
        raise ValidationError(f"delay must be seconds or a timedelta, got {_show(delay)}")
    if not math.isfinite(seconds) or seconds < 0:
        raise ValidationError(f"delay must be a finite number >= 0, got {_show(delay)}")
    at = now_ms + round(seconds * 1000)
    if at > latest:
        raise ValidationError(f"delay {seconds:g}s is too far ahead: at most "
                              f"{MAX_HORIZON_MS // 86_400_000} days")
    return at


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


def _target(task_type: str, processor: Any, callback_url: Any) -> tuple[str | None, str | None]:
    if processor is not None and callback_url is not None:
        raise ValidationError("give processor or callback_url, not both")
    if callback_url is not None:
        return None, _callback(callback_url)
    if processor is None:
        return task_type, None
    return _text("processor", processor, MAX_PROCESSOR), None


def _text(name: str, value: Any, limit: int) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValidationError(f"{name} must be a non-empty string, got {_show(value)}")
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


def build_row(settings: Settings, now_ms: int, task_type: Any, payload: Any, *,
              run_at: datetime | None = None, delay: Any = None, priority: str = "default",
              biz_key: str | None = None, max_retry: int | None = None,
              timeout_ms: int | None = None, processor: str | None = None,
              callback_url: str | None = None, trace_id: str | None = None) -> dict[str, Any]:
    """Validate one task and return its row (without ``task_id``).

    Every field is bounded (see the ``MAX_*`` constants above): text fields by
    type, length and valid Unicode, numbers by type and range, the trigger time
    by how far ahead it is, the payload by JSON, size and depth.

    Raises:
        ValidationError: any argument is invalid.
    """
    task_type = _text("task_type", task_type, MAX_TASK_TYPE)
    if not isinstance(priority, str) or priority not in PRIORITIES:
        raise ValidationError(f"unknown priority {_show(priority)}; use one of "
                              f"{', '.join(PRIORITIES)}")
    if biz_key is not None:
        biz_key = _text("biz_key", biz_key, MAX_BIZ_KEY)
    processor_name, callback = _target(task_type, processor, callback_url)
    payload_json = canonical_json(payload, settings.max_payload_bytes)
    return {
        "task_type": task_type,
        "trigger_time": trigger_ms(now_ms, run_at, delay),
        "status": Status.CREATED.value,
        "priority": str(priority),
        "retry_count": 0,
        "max_retry": _as_int("max_retry", settings.default_max_retry if max_retry is None
                             else max_retry, 0, MAX_RETRY),
        "timeout_ms": _as_int("timeout_ms", settings.default_timeout_ms if timeout_ms is None
                              else timeout_ms, 1, MAX_TIMEOUT_MS),
        "processor_name": processor_name,
        "callback_url": callback,
        "payload": payload_json,
        "biz_key": biz_key,
        "fingerprint": fingerprint(task_type, payload_json),
        "trace_id": _trace_id(trace_id),
        "attempt": 0,
        "created_at": now_ms,
    }


class Client:
    """A producer's handle on one store. Thread-safe; one per process is enough."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.store = Store(settings)
        owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.ids = LeasedIds(StoreLessor(self.store.engine), owner,
                             settings.node_lease_s * 1000, self.store.now_ms)
        self.pid = os.getpid()

    def enqueue(self, task_type: str, payload: Any = None, **options: Any) -> TaskId:
        """Create one task; see :func:`ax_kombu.enqueue` for the arguments.

        Returns:
            The task id; ``.created`` is False when it matched an existing task.
        Raises:
            ValidationError: bad input; nothing was written.
        """
        return self.enqueue_many([dict(options, task_type=task_type, payload=payload)])[0]

    def enqueue_many(self, items: Iterable[Mapping[str, Any]]) -> list[TaskId]:
        """Create many tasks in one transaction; each item holds enqueue's arguments.

        Raises:
            ValidationError: any item is invalid; nothing was written.
        """
        if isinstance(items, (str, bytes, Mapping)) or not isinstance(items, Iterable):
            raise ValidationError("enqueue_many takes an iterable of mappings of enqueue "
                                  f"arguments, got {type(items).__name__}")
        now = self.store.now_ms()
        rows = [self._row(now, i, item) for i, item in enumerate(items)]
        if not rows:
            return []
        for row, task_id in zip(rows, self.ids.next_ids(len(rows)), strict=True):
            row["task_id"] = task_id
        results = insert_tasks(self.store.engine, rows, self.settings.dedup_window_ms,
                               wake_before_ms=now + self.settings.preload_window_ms)
        return [TaskId(task_id, created) for task_id, created in results]

    def _row(self, now: int, index: int, item: Mapping[str, Any]) -> dict[str, Any]:
        if not isinstance(item, Mapping):
            raise ValidationError(f"item {index} is not a mapping of enqueue arguments")
        unknown = set(item) - _TASK_ARGS
        if unknown:
            raise ValidationError(f"item {index}: unknown argument(s) "
                                  f"{', '.join(sorted(_show(k) for k in unknown))}")
        if "task_type" not in item:
            raise ValidationError(f"item {index} has no task_type")
        args = dict(item)
        return build_row(self.settings, now, args.pop("task_type"), args.pop("payload", None),
                         **args)

    def get(self, task_id: int) -> TaskView:
        """The task ``task_id``.

        Raises:
            TaskNotFound: no such task.
        """
        with self.store.engine.connect() as conn:
            row = fetch_task(conn, int(task_id))
        if row is None:
            raise TaskNotFound(f"no task {task_id}")
        return TaskView.from_row(dict(row._mapping))

    def cancel(self, task_id: int) -> TaskView:
        """Cancel a task that has not finished.

        Raises:
            TaskNotFound: no such task.
            IllegalTransition: the task is already SUCCESS, FAILED or CANCELLED.
        """
        with self.store.engine.begin() as conn:
            moved = transitions.transition(conn, [int(task_id)], states.ACTIVE, Status.CANCELLED,
                                      values={"finished_at": self.store.now_ms()})
        view = self.get(task_id)
        if not moved:
            raise IllegalTransition(f"task {task_id} is {view.status}; only a task that has "
                                    "not finished can be cancelled")
        return view

    def close(self) -> None:
        self.ids.release()
        self.store.close()
