"""HTTP callbacks: how a task's ``callback_url`` is called, and what it may not reach.

A task with a ``callback_url`` runs as an HTTP ``POST`` of
``{"payload", "task_id", "attempt", "trace_id"}`` (JSON, with an ``X-Trace-Id``
header; an occurrence of a recurring job adds ``"job"`` and ``"scheduled_at"``). A 2xx
answer is success; anything else is a failure, whose meaning the status gives:

- **4xx but 408 and 429**: the receiver refuses the request itself, and sending it again
  cannot help: discarded (``ax.Discard``: FAILED at once, no retry).
- **429, 5xx, 408**: retried (``ax.Retry``, counted against ``max_retry``) after the
  answer's ``Retry-After`` (seconds, or an HTTP date), at most
  :data:`MAX_RETRY_AFTER_S` (one hour); without one, after the worker's back-off.
- **A connection error, no complete answer in time, a 3xx**: a plain failure, retried
  after the back-off.

A callback_url comes from whoever could enqueue a task (or write to the broker), so the
call is made as if the URL were hostile:

- **http and https only.** Any other scheme, or a URL without a host, is
  refused (:class:`~ax_kombu.exceptions.ProcessorRefused`: final, no retry).
- **No internal addresses by default.** The host is resolved once, and if any
  address it resolves to is loopback, private, link-local, multicast, reserved,
  unspecified or otherwise not globally routable (IPv4-mapped, 6to4 and NAT64
  forms are unwrapped first), the call is refused *before any connection is
  made*. The connection then goes to the very address that was checked — there
  is no second DNS lookup between check and connect — while the ``Host`` header,
  TLS SNI and certificate verification use the name from the URL.
- **AX_CALLBACK_ALLOW_HOSTS** (comma separated: ``hooks.example.com``,
  ``*.internal``, ``127.0.0.1``, ``localhost``): when set, only those hosts may
  be called, and a host on the list may resolve to internal addresses (the list
  is how internal receivers are allowed on purpose).
- **One deadline per call**: the task's remaining ``timeout_ms`` covers the DNS
  lookup, connect, TLS handshake, sending and reading the whole answer. Socket
  timeouts alone do not bound a server that sends one byte a second, so a
  watchdog thread shuts the call's socket down when the deadline passes.
- **No redirects**: a 3xx answer is a failure and is never followed.
- **Answers are capped**: at most 64 KiB of the answer is read (and
  discarded); past that the connection is closed, the rest never read. Only the
  status is kept; ``last_error`` never echoes the answer's body, and URLs in
  errors have their password and query-string values redacted.
- Connections are pooled (urllib3) per (scheme, checked address, port, host
  name), shared by all threads.

**Signing.** With ``AX_CALLBACK_SECRET`` set, every request is signed per Standard Webhooks
(:mod:`ax_kombu.alerts.signing`): ``webhook-id`` (``msg_ax_<task id>_<attempt>``, the same
for every send of one attempt), ``webhook-timestamp`` (unix seconds) and
``webhook-signature`` (``v1,`` + base64 HMAC-SHA256 of ``id.timestamp.body``). The secret
is ``whsec_`` + base64 of the key, or any other text, used as its UTF-8 bytes. A receiver
checks it with a Standard Webhooks library::

    from standardwebhooks import Webhook
    Webhook(secret).verify(raw_body, headers)   # or Webhook(secret.encode()) for plain text

**Legacy signing** (``AX_CALLBACK_SIGNING=legacy``, kept for one release): the request
carries ``X-Ax-Timestamp: <unix seconds>`` and ``X-Ax-Signature: sha256=<hex>``, where
``<hex>`` is the HMAC-SHA256, keyed with the secret (UTF-8), of the bytes
``<timestamp> + "." + <raw request body>``. A receiver checks it with::

    def verify(secret: bytes, headers, body: bytes, tolerance_s: int = 300) -> bool:
        ts = headers["X-Ax-Timestamp"]
        mac = hmac.new(secret, ts.encode() + b"." + body, hashlib.sha256).hexdigest()
        fresh = abs(time.time() - int(ts)) <= tolerance_s
        return fresh and hmac.compare_digest("sha256=" + mac, headers["X-Ax-Signature"])

(in both, the body must be the raw bytes received, before any JSON parsing).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from collections.abc import Callable, Iterable
from datetime import UTC
from email.utils import parsedate_to_datetime
from typing import Any, NamedTuple
from urllib.parse import unquote

import urllib3
from urllib3.connectionpool import HTTPConnectionPool
from urllib3.exceptions import (
    HTTPError,
    NewConnectionError,
    ProtocolError,
    SSLError,
)
from urllib3.exceptions import (
    TimeoutError as Urllib3Timeout,
)

from ax_kombu.alerts import signing
from ax_kombu.config import redact_url
from ax_kombu.core.context import Context
from ax_kombu.exceptions import CallbackFailed, Discard, Retry
from ax_kombu.worker.callback_http import Call, current_expired, deadline_scope, pools
from ax_kombu.worker.callback_targets import (
    Target,
    check_callback_url,
    host_allowed,
    parse_target,
    resolve_checked,
)

#: bytes of a callback's answer that are read (and discarded); the rest is never read
MAX_ANSWER = 65536
#: the longest ``Retry-After`` honoured, in seconds: a longer one waits this long
MAX_RETRY_AFTER_S = 3600.0
#: 4xx statuses that are retried: Request Timeout, Too Many Requests
_RETRIED_4XX = frozenset({408, 429})

class CallbackDiscarded(Discard, CallbackFailed):
    """A callback answered a 4xx status other than 408 and 429: FAILED, no retry."""


class CallbackRetry(Retry, CallbackFailed):
    """A callback answered 408, 429 or 5xx: retried, after its Retry-After if it gave one."""


def retry_after(value: str | None, now_s: float, cap_s: float = MAX_RETRY_AFTER_S
                ) -> float | None:
    """The delay a ``Retry-After`` header asks for, in seconds within ``[0, cap_s]``: a
    number of seconds, or an HTTP date (its distance from ``now_s``, epoch seconds; a past
    date is 0). None: no header, or one that is neither.
    """
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return min(float(value), cap_s)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # an HTTP date is GMT (parsedate reads "-0000" as no zone)
        when = when.replace(tzinfo=UTC)
    return min(max(when.timestamp() - now_s, 0.0), cap_s)


def answer_failure(status: int, retry_after_s: float | None) -> CallbackFailed:
    """The error a non-2xx ``status`` is raised as (see the module docstring)."""
    reason = f"callback answered HTTP {status}"
    if 400 <= status < 500 and status not in _RETRIED_4XX:
        return CallbackDiscarded(reason)
    if status >= 500 or status in _RETRIED_4XX:
        return CallbackRetry(retry_after_s, reason)
    return CallbackFailed(reason)


# --- the call -------------------------------------------------------------------------------


def sign(secret: str, timestamp: str, body: bytes) -> str:
    """Legacy signing: the ``X-Ax-Signature`` value: ``sha256=`` + hex HMAC-SHA256 of ``timestamp.body``."""
    mac = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256)
    return f"sha256={mac.hexdigest()}"


def _headers(target: Target, body: bytes, ctx: Context, secret: str,
             scheme: str) -> dict[str, str]:
    host = f"[{target.host}]" if ":" in target.host else target.host
    default = 443 if target.scheme == "https" else 80
    headers = {"Host": host if target.port == default else f"{host}:{target.port}",
               "Content-Type": "application/json", "Accept-Encoding": "identity",
               "X-Trace-Id": ctx.trace_id}
    if target.userinfo is not None:
        headers.update(urllib3.util.make_headers(basic_auth=unquote(target.userinfo)))
    if secret and scheme == "legacy":
        timestamp = str(int(time.time()))
        headers["X-Ax-Timestamp"] = timestamp
        headers["X-Ax-Signature"] = sign(secret, timestamp, body)
    elif secret:
        headers.update(signing.headers(signing.signer(secret),
                                       f"msg_ax_{ctx.task_id}_{ctx.attempt}", body, time.time()))
    return headers


class Answer(NamedTuple):
    """What is kept of a callback's answer."""

    status: int
    #: its ``Retry-After`` header, as sent (None: none)
    retry_after: str | None = None


def _exchange(pool: HTTPConnectionPool, target: Target, body: bytes,
              headers: dict[str, str], call: Call) -> Answer:
    """Send the request and read at most MAX_ANSWER bytes of the answer."""
    remaining = call.remaining()
    if remaining <= 0:
        raise Urllib3Timeout("deadline passed")
    answer = pool.urlopen("POST", target.path, body=body, headers=headers, retries=False,
                          redirect=False, assert_same_host=False, preload_content=False,
                          decode_content=False,
                          timeout=urllib3.Timeout(connect=remaining, read=remaining))
    complete, read = False, 0
    try:
        for chunk in answer.stream(8192, decode_content=False):
            read += len(chunk)
            if read >= MAX_ANSWER or call.remaining() <= 0:
                break
        else:
            complete = True
    finally:
        if not complete:
            answer.close()  # the rest is not read: the connection cannot be reused
        answer.release_conn()
    if call.expired or (not complete and read < MAX_ANSWER):
        raise Urllib3Timeout("deadline passed")  # a truncated answer is no answer
    return Answer(int(answer.status), answer.headers.get("Retry-After"))


def _failure(exc: BaseException, url: str, timeout_s: float) -> CallbackFailed:
    # NewConnectionError is a ConnectTimeoutError in urllib3 2: look at it first
    if isinstance(exc, NewConnectionError) and not current_expired():
        reason = exc.__cause__ or exc
        return CallbackFailed(f"callback failed: cannot connect to {redact_url(url)}: "
                              f"{getattr(reason, 'strerror', None) or type(reason).__name__}")
    if isinstance(exc, (Urllib3Timeout, TimeoutError, NewConnectionError)) or current_expired():
        return CallbackFailed(f"callback did not answer within {timeout_s:.3g}s")
    if isinstance(exc, SSLError):
        return CallbackFailed(f"callback failed: TLS error with {redact_url(url)}: "
                              f"{exc.__cause__ or exc}")
    if isinstance(exc, ProtocolError):
        return CallbackFailed(f"callback failed: the connection to {redact_url(url)} broke "
                              "before a complete answer")
    return CallbackFailed(f"callback failed: {type(exc).__name__} calling {redact_url(url)}")


def post_callback(url: str, payload: Any, ctx: Context, timeout_s: float, *,
                  allow_hosts: Iterable[str] = (), secret: str = "",
                  signing_scheme: str = "standard") -> int:
    """POST the task to ``url`` within ``timeout_s`` in all; returns the 2xx status.

    Args:
        allow_hosts: AX_CALLBACK_ALLOW_HOSTS; a host on it may be internal, and when it is
            not empty no other host may be called.
        secret: AX_CALLBACK_SECRET; signs the request when not empty.
        signing_scheme: AX_CALLBACK_SIGNING, ``standard`` or ``legacy`` (module docstring).

    Raises:
        ProcessorRefused: not http(s), a host not allowed, or an internal address.
        CallbackFailed: a non-2xx status, a connection error, or no complete answer in
            time; for a status, a :class:`CallbackDiscarded` or a :class:`CallbackRetry`
            (:func:`answer_failure`).
    """
    deadline = time.monotonic() + timeout_s
    hosts = tuple(allow_hosts)
    check_callback_url(url, hosts)
    target = parse_target(url)
    addresses = resolve_checked(target, host_allowed(target.host, hosts), timeout_s)
    fields = {"payload": payload, "task_id": ctx.task_id, "attempt": ctx.attempt,
              "trace_id": ctx.trace_id}
    if ctx.job is not None:
        fields.update(job=ctx.job, scheduled_at=ctx.scheduled_at)
    body = json.dumps(fields).encode()
    headers = _headers(target, body, ctx, secret, signing_scheme)
    answer = _call(target, addresses, body, headers, deadline, url, timeout_s)
    if not 200 <= answer.status < 300:
        raise answer_failure(answer.status, retry_after(answer.retry_after, time.time()))
    return answer.status


def _call(target: Target, addresses: list[str], body: bytes, headers: dict[str, str],
          deadline: float, url: str, timeout_s: float) -> Answer:
    """The status of the first address that accepts a connection (the next on a refusal)."""
    with deadline_scope(deadline) as call:
        for i, address in enumerate(addresses):
            pool = pools.get(target.scheme, address, target.port, target.host)
            try:
                return _exchange(pool, target, body, headers, call)
            except NewConnectionError as exc:
                if i == len(addresses) - 1 or current_expired():
                    raise _failure(exc, url, timeout_s) from None
            except (HTTPError, OSError) as exc:
                raise _failure(exc, url, timeout_s) from None
    raise CallbackFailed("callback failed: no address to call")


def callback_processor(url: str, allow_hosts: Iterable[str] = (), secret: str = "",
                       signing_scheme: str = "standard") -> Callable[[Any, Context], int]:
    """The processor of a task with ``url`` as its callback_url: POSTs within the run's
    remaining time (``ctx.deadline``, else ``ctx.timeout_ms``), signed with ``secret``
    per ``signing_scheme`` (module docstring)."""
    hosts = tuple(allow_hosts)

    def call(payload: Any, ctx: Context) -> int:
        timeout_s = ctx.timeout_ms / 1000.0
        if ctx.deadline is not None:
            timeout_s = max(0.0, min(timeout_s, ctx.deadline - time.monotonic()))
        return post_callback(url, payload, ctx, timeout_s, allow_hosts=hosts, secret=secret,
                             signing_scheme=signing_scheme)

    return call
