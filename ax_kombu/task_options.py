"""What a typed task (:mod:`ax_kombu.tasks`) checks at decoration: its options' names and
signatures (:class:`Options`, the one place they are written), the decorator's arguments
(``timeout="30s"``…), and the function's signature. Pure: no I/O."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from ax_kombu.config import PRIORITIES
from ax_kombu.core.backoff import Backoff
from ax_kombu.core.values import MAX_RETRY, MAX_TIMEOUT_MS
from ax_kombu.exceptions import ValidationError

__all__ = ["ENQUEUE_OPTIONS", "SCHEDULE_OPTIONS", "VARIADIC", "Options", "check_defaults",
           "parse_timeout", "signatures"]

VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
_TIMEOUT = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)\s*")
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000}


class Options:
    """The options' signatures, the one place they are written: the runtime reads their
    names from here, and the mypy plugin their types from a task's own class (so these
    methods are inherited, and do nothing)."""

    def _enqueue_options(self, *, delay: float | timedelta | None = None,
                         run_at: datetime | None = None, biz_key: str | None = None,
                         connection: Any = None, priority: str | None = None,
                         max_retry: int | None = None, timeout_ms: int | None = None,
                         unique: str = "always", on_conflict: str = "keep",
                         order_key: str | None = None, order_policy: str = "hold_failed",
                         shards: int | str | None = None, trace_id: str | None = None) -> None:
        """:func:`ax_kombu.enqueue`'s options."""

    def _schedule_options(self, *, cron: str | None = None,
                          every: float | timedelta | None = None, tz: str = "UTC",
                          misfire: str = "fire_once", misfire_grace_s: float | None = None,
                          strategy: str = "parallel", priority: str | None = None,
                          max_retry: int | None = None, timeout_ms: int | None = None) -> None:
        """:func:`ax_kombu.schedule`'s options."""


def _names(method: Callable[..., None]) -> frozenset[str]:
    return frozenset(n for n in inspect.signature(method).parameters if n != "self")


#: the keyword arguments ``enqueue``, ``aenqueue`` and ``item`` take as options
ENQUEUE_OPTIONS = _names(Options._enqueue_options)
#: the keyword arguments ``schedule`` takes as options
SCHEDULE_OPTIONS = _names(Options._schedule_options)

def parse_timeout(timeout: Any) -> int | None:
    """``timeout`` in ms: seconds (int or float), a timedelta, or ``"250ms"``, ``"30s"``,
    ``"5m"``, ``"1h"`` (None: the default).

    Raises:
        ValidationError: another value, or not within 1 ms..7 days.
    """
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        ms = timeout / timedelta(milliseconds=1)
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        ms = timeout * 1000.0
    elif isinstance(timeout, str) and (found := _TIMEOUT.fullmatch(timeout)):
        ms = float(found.group(1)) * _UNIT_MS[found.group(2)]
    else:
        raise ValidationError(f"timeout {timeout!r}: give seconds, a timedelta, or a string "
                              "such as '250ms', '30s', '5m', '1h'")
    if not 1 <= ms <= MAX_TIMEOUT_MS:
        raise ValidationError(f"timeout {timeout!r} is not within 1 ms and 7 days")
    return round(ms)


def check_defaults(task_type: Any, priority: Any, max_retry: Any, retry_on: Any,
                    backoff: Any) -> None:
    """The decorator's arguments, checked (``ValidationError`` naming the first bad one)."""
    if not isinstance(task_type, str) or not task_type:
        raise ValidationError("task() needs a non-empty task type")
    if priority not in PRIORITIES:
        raise ValidationError(f"task {task_type!r}: unknown priority {priority!r}; use one of "
                              f"{', '.join(PRIORITIES)}")
    if max_retry is not None and (isinstance(max_retry, bool) or not isinstance(max_retry, int)
                                  or not 0 <= max_retry <= MAX_RETRY):
        raise ValidationError(f"task {task_type!r}: max_retry must be an int in 0..{MAX_RETRY}")
    if retry_on is not None and not (isinstance(retry_on, tuple) and all(
            isinstance(c, type) and issubclass(c, BaseException) for c in retry_on)):
        raise ValidationError(f"task {task_type!r}: retry_on must be a tuple of exception "
                              f"classes, got {retry_on!r}")
    if backoff is not None and not isinstance(backoff, Backoff):
        raise ValidationError(f"task {task_type!r}: backoff must be an ax.Backoff")


def signatures(task_type: str, fn: Callable[..., Any]) -> tuple[inspect.Signature, bool]:
    """The signature arguments are bound to (without ``ctx``), and whether ``fn`` has a
    ``ctx`` parameter.

    Raises:
        ValidationError: not a function with a signature, a variadic ``ctx``, or a
            parameter named like an option.
    """
    try:
        full = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise ValidationError(f"task {task_type!r}: {fn!r} has no signature ({exc})") from None
    ctx = full.parameters.get("ctx")
    if ctx is not None and ctx.kind in VARIADIC:
        raise ValidationError(f"task {task_type!r}: ctx must be a plain parameter")
    clash = sorted(set(full.parameters) & (ENQUEUE_OPTIONS | SCHEDULE_OPTIONS))
    if clash:
        raise ValidationError(
            f"task {task_type!r}: parameter(s) {', '.join(clash)} of {fn.__qualname__} are "
            "named like enqueue or schedule options; rename them (or register the function "
            "with @ax.processor and a payload object)")
    bare = full.replace(parameters=[p for n, p in full.parameters.items() if n != "ctx"])
    return bare, ctx is not None
