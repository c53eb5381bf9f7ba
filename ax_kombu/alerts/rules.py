"""What an alert is, checked before anything is written (``ax.set_alert``).

An alert watches one task type for ``failed`` (a task ended FAILED, its retries spent) and
or ``late`` (a task had not started ``late_after`` past its trigger time), and POSTs its
incidents to ``webhook`` (http or https), signed with ``secret``: a Standard Webhooks key,
``whsec_`` + base64 of 24 to 64 random bytes; one is made when none is given.
"""

from __future__ import annotations

import base64
import binascii
import secrets
from collections.abc import Iterable
from datetime import timedelta
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from ax_kombu.config import parse_duration_ms
from ax_kombu.core.values import MAX_TASK_TYPE, check_text, show
from ax_kombu.exceptions import ConfigurationError, ValidationError

#: what an alert may watch
EVENTS = ("failed", "late")
#: the longest ``late_after``: a week
MAX_LATE_AFTER_MS = 7 * 86_400_000
MAX_WEBHOOK = 2048
SECRET_PREFIX = "whsec_"


class Alert(NamedTuple):
    """An alert as checked (see the module docstring); ``late_after_ms`` None without
    ``late``."""

    task_type: str
    on: frozenset[str]
    late_after_ms: int | None
    webhook: str
    secret: str

    def row(self) -> dict[str, Any]:
        """The alert's settings as ``ax_alert`` columns."""
        return {"task_type": self.task_type, "on_failed": "failed" in self.on,
                "on_late": "late" in self.on, "late_after_ms": self.late_after_ms,
                "webhook": self.webhook, "secret": self.secret}


def new_secret() -> str:
    """A fresh signing secret: ``whsec_`` + base64 of 32 random bytes."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()


def check_events(on: Any) -> frozenset[str]:
    """``on`` (a name or names of :data:`EVENTS`) as a non-empty set."""
    names = [on] if isinstance(on, str) else on
    if not isinstance(names, Iterable) or isinstance(names, (bytes, dict)):
        raise ValidationError(f"on must be names among {', '.join(EVENTS)}, got {show(on)}")
    found = frozenset(names)
    unknown = sorted(str(n) for n in found if n not in EVENTS)
    if unknown or not found:
        raise ValidationError(f"on must name at least one of {', '.join(EVENTS)}, got "
                              f"{show(on)}")
    return found


def check_late_after(value: Any) -> int:
    """``value`` (seconds, a timedelta, or ``"30s"``, ``"5m"``…) in ms, within 1 s..7 days."""
    if isinstance(value, timedelta):
        ms = round(value / timedelta(milliseconds=1))
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        ms = round(value * 1000)
    elif isinstance(value, str):
        try:
            ms = parse_duration_ms(value)
        except ConfigurationError:
            raise ValidationError(f"late_after {value!r} is not a duration (e.g. 30s, 5m, "
                                  "1h)") from None
    else:
        raise ValidationError(f"late_after must be seconds, a timedelta or a duration such "
                              f"as '30s', got {show(value)}")
    if not 1000 <= ms <= MAX_LATE_AFTER_MS:
        raise ValidationError(f"late_after must be between 1s and 7d, got {show(value)}")
    return ms


def check_webhook(url: Any) -> str:
    """``url`` if it is an http(s) URL with a host."""
    url = check_text("webhook", url, MAX_WEBHOOK)
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises for a port that is not a number
    except ValueError:
        raise ValidationError(f"webhook is not a URL: {url!r}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValidationError(f"webhook must be an http:// or https:// URL with a host, "
                              f"got {url!r}")
    return str(url)


def check_secret(secret: Any) -> str:
    """``secret`` if it is ``whsec_`` + base64 of 24 to 64 bytes."""
    if not isinstance(secret, str) or not secret.startswith(SECRET_PREFIX):
        raise ValidationError("secret must be a Standard Webhooks secret: 'whsec_' + base64")
    try:
        key = base64.b64decode(secret[len(SECRET_PREFIX):], validate=True)
    except (binascii.Error, ValueError):
        raise ValidationError("secret must be 'whsec_' + base64; the rest is not base64"
                              ) from None
    if not 24 <= len(key) <= 64:
        raise ValidationError(f"secret must hold 24 to 64 bytes, it holds {len(key)}")
    return secret


def check_alert(task_type: Any, on: Any, late_after: Any, webhook: Any,
                secret: Any) -> Alert:
    """The alert these arguments describe (``on`` None: ``failed``, and ``late`` with a
    ``late_after``; ``secret`` None: a new one is made).

    Raises:
        ValidationError: a bad type, event, duration, URL or secret; ``late`` without
            ``late_after``, or ``late_after`` without ``late``.
    """
    task_type = check_text("task_type", task_type, MAX_TASK_TYPE)
    if on is None:
        on = ("failed",) if late_after is None else ("failed", "late")
    events = check_events(on)
    if "late" in events and late_after is None:
        raise ValidationError("an alert on 'late' needs late_after (e.g. '30s')")
    if "late" not in events and late_after is not None:
        raise ValidationError("late_after applies only to an alert on 'late'")
    late_ms = None if late_after is None else check_late_after(late_after)
    url = check_webhook(webhook)
    key = new_secret() if secret is None else check_secret(secret)
    return Alert(task_type, events, late_ms, url, key)
