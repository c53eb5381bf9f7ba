"""Producer-side validation: the row an ``enqueue`` becomes.

Contract: :func:`build_row` either returns a row every column of the store
accepts, or raises :class:`~ax_kombu.exceptions.ValidationError` naming the
field — never a database error later. Each value is checked by
:mod:`ax_kombu.core.values` (text, integers, the trigger time) and the payload by
:mod:`ax_kombu.core.fingerprint` (JSON with string keys, no NaN or Infinity, 64-bit
integers, size, depth and value count), which also gives the duplicate check its key;
here: the priority, the target (a processor or an http(s) callback), the runner, the
order key, shards. A row also takes the W3C trace context current when it is built
(:func:`ax_kombu.observability.tracing.current_context_headers`; None without one).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit

from ax_kombu.config import PRIORITIES, Settings
from ax_kombu.core.fingerprint import canonical_json, fingerprint
from ax_kombu.core.runners import CELERY_RUNNERS
from ax_kombu.core.values import (
    MAX_BIZ_KEY,
    MAX_CALLBACK_URL,
    MAX_PROCESSOR,
    MAX_RETRY,
    MAX_TASK_TYPE,
    MAX_TIMEOUT_MS,
    as_int,
    check_text,
    check_trace_id,
    check_utf8,
    initial_status,
    show,
    trigger_ms,
)
from ax_kombu.exceptions import ValidationError
from ax_kombu.observability.redaction import redact_url
from ax_kombu.observability.tracing import current_context_headers, trace_id_of


def _callback(url: Any) -> str:
    if not isinstance(url, str):
        raise ValidationError(f"callback_url must be a string, got {type(url).__name__}")
    if len(url) > MAX_CALLBACK_URL:
        raise ValidationError(f"callback_url is longer than {MAX_CALLBACK_URL} characters")
    check_utf8("callback_url", url)
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
    return check_text("processor", processor, MAX_PROCESSOR), None


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
    return check_text("order_key", order_key, MAX_ORDER_KEY), ORDER_POLICIES[order_policy]


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
    return as_int("shards", shards, 1, MAX_SHARDS)


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

    Every field is bounded (the ``MAX_*`` constants of :mod:`ax_kombu.core.values`): text fields by
    type, length and valid Unicode, numbers by type and range, the trigger time
    by how far ahead it is, the payload by JSON, size and depth.

    ``runner``: a Celery runner, from :mod:`ax_kombu.celery` only (None: ``'callback'``
    with a ``callback_url``, else ``'ax'``; see :func:`check_route`).

    ``traceparent``/``tracestate``: the current OpenTelemetry span's context (None
    without one); ``trace_id`` not given is then its trace id (32 hex digits).

    Raises:
        ValidationError: any argument is invalid.
    """
    task_type = check_text("task_type", task_type, MAX_TASK_TYPE)
    _priority(priority)
    if biz_key is not None:
        biz_key = check_text("biz_key", biz_key, MAX_BIZ_KEY)
    processor_name, callback = _target(task_type, processor, callback_url)
    payload_json = canonical_json(payload, settings.max_payload_bytes)
    key, gate = _order(order_key, order_policy)
    trigger = trigger_ms(now_ms, run_at, delay)
    parent, state = current_context_headers()
    if trace_id is None and parent is not None:
        trace_id = trace_id_of(parent)
    return {
        "task_type": task_type,
        "trigger_time": trigger,
        "order_key": key, "order_seq": trigger if key is not None else None, "gate": gate,
        "status": initial_status(trigger, now_ms),
        "priority": str(priority),
        "retry_count": 0,
        "max_retry": as_int("max_retry", settings.default_max_retry if max_retry is None
                             else max_retry, 0, MAX_RETRY),
        "timeout_ms": as_int("timeout_ms", settings.default_timeout_ms if timeout_ms is None
                              else timeout_ms, 1, MAX_TIMEOUT_MS),
        "processor_name": processor_name,
        "callback_url": callback,
        "runner": _runner(processor_name, callback, runner),
        "payload": payload_json,
        "biz_key": biz_key,
        "fingerprint": fingerprint(task_type, payload_json),
        "trace_id": check_trace_id(trace_id),
        "attempt": 0,
        "created_at": now_ms,
        "traceparent": parent, "tracestate": state,
    }
