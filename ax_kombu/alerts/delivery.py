"""Delivery of alert notifications: a POST each, signed, retried with back-off on a thread
of its own.

:meth:`Delivery.send` only queues (it never waits on the network), so the evaluator that
calls it, and the scheduler around it, never block on a slow or dead receiver. The thread
POSTs each message with a :data:`TIMEOUT_S` bound; a 2xx answer delivers it, anything else
(another status, no connection, no answer in time) tries again after 1, 2, 4… s (at most
:data:`MAX_BACKOFF_S`), :data:`ATTEMPTS` tries in all, then this thread gives the message
up, with a warning. Retries keep the message's ``webhook-id`` and are signed anew (a fresh
``webhook-timestamp``). Redirects are not followed. A message already queued or in flight
(by its ``webhook-id``) is not queued again.

What outlives the process is the alert's outbox (:mod:`ax_kombu.alerts.outbox`), told
through :class:`Hooks`: a delivered message is taken out of it, a retry pushes back the
time another scheduler may take it over (a message another scheduler has taken over is
left to that one), a message given up stays in it for a later takeover. At most :data:`MAX_QUEUED`
messages wait here; past that the oldest leaves this queue, with a warning (it stays in
its outbox).
"""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import urllib3

from ax_kombu.alerts import signing
from ax_kombu.config import redact_url

log = logging.getLogger(__name__)

#: one POST's bound (connect and read)
TIMEOUT_S = 10.0
#: tries of one message, the first included
ATTEMPTS = 8
MAX_BACKOFF_S = 60.0
MAX_QUEUED = 1000


class Message(NamedTuple):
    """A notification to send: ``body`` is JSON-encoded once, signed on each try."""

    url: str
    secret: str
    message_id: str
    body: dict[str, Any]
    #: the alert's task type (its outbox row); "" for a message of no outbox
    task_type: str = ""


class Hooks(Protocol):
    """What the sending thread tells the outbox (called on that thread)."""

    def delivered(self, message: Message) -> None: ...

    def retrying(self, message: Message, wait_s: float) -> bool:
        """A try failed and the next is in ``wait_s``; False: another scheduler has taken
        the message over, do not retry here."""
        ...

    def gave_up(self, message: Message) -> None: ...


class _Due(NamedTuple):
    at: float
    seq: int
    message: Message
    attempt: int


class Delivery:
    """The sending thread (started on the first :meth:`send`).

    Args:
        post: ``post(url, body, headers, timeout_s) -> status`` (tests replace it).
        backoff_s: the first retry's wait; it doubles per try.
    """

    def __init__(self, post: Callable[[str, bytes, dict[str, str], float], int] | None = None,
                 *, backoff_s: float = 1.0, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self._post = post or _urllib3_post
        self._backoff_s = backoff_s
        self._clock = clock
        self._cond = threading.Condition()
        self._due: list[_Due] = []
        self._seq = itertools.count()
        self._stopped = False
        self._thread: threading.Thread | None = None
        #: the ids of the messages queued or in flight
        self._taken_ids: set[str] = set()
        #: the outbox told of deliveries, retries and give-ups (None: none)
        self.hooks: Hooks | None = None
        self.delivered = 0
        self.dropped = 0

    def send(self, message: Message) -> None:
        """Queue ``message`` for delivery now (unless it is queued or in flight already);
        returns at once."""
        with self._cond:
            if self._stopped or message.message_id in self._taken_ids:
                return
            if len(self._due) >= MAX_QUEUED:
                oldest = min(self._due, key=lambda d: d.seq)
                self._due.remove(oldest)
                heapq.heapify(self._due)
                self._taken_ids.discard(oldest.message.message_id)
                self.dropped += 1
                log.warning("alert delivery queue full; the oldest message is dropped",
                            extra={"message_id": oldest.message.message_id})
            heapq.heappush(self._due, _Due(self._clock(), next(self._seq), message, 1))
            self._taken_ids.add(message.message_id)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ax-alert-delivery",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()

    def stop(self, grace_s: float = 2.0) -> None:
        """Stop after at most ``grace_s``: messages not yet delivered leave this queue
        (they stay in their outbox)."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(grace_s)

    def pending(self) -> int:
        with self._cond:
            return len(self._due)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and (not self._due or self._due[0].at > self._clock()):
                    self._cond.wait(None if not self._due else self._due[0].at - self._clock())
                if self._stopped:
                    return
                due = heapq.heappop(self._due)
            self._try(due)

    def _try(self, due: _Due) -> None:
        message = due.message
        body = json.dumps(message.body, separators=(",", ":")).encode()
        try:
            sign = signing.headers(signing.signer(message.secret), message.message_id, body,
                                   time.time())
            status = self._post(message.url, body, {"content-type": "application/json",
                                                    **sign}, TIMEOUT_S)
            error = None if 200 <= status < 300 else f"HTTP {status}"
        except Exception as exc:  # noqa: BLE001 - any failure of one try is retried
            error = type(exc).__name__
        if error is None:
            self._forget(message)
            self.delivered += 1
            if self.hooks is not None:
                self.hooks.delivered(message)
            return
        extra = {"message_id": message.message_id, "url": redact_url(message.url),
                 "attempt": due.attempt, "error": error}
        if due.attempt >= ATTEMPTS:
            self._forget(message)
            self.dropped += 1
            log.warning("alert not delivered; giving up for now", extra=extra)
            if self.hooks is not None:
                self.hooks.gave_up(message)
            return
        wait = min(self._backoff_s * 2 ** (due.attempt - 1), MAX_BACKOFF_S)
        if self.hooks is not None and not self.hooks.retrying(message, wait):
            self._forget(message)
            log.info("alert not delivered; another scheduler delivers it now", extra=extra)
            return
        log.info("alert not delivered; trying again", extra=extra)
        with self._cond:
            heapq.heappush(self._due, _Due(self._clock() + wait, next(self._seq), message,
                                           due.attempt + 1))

    def _forget(self, message: Message) -> None:
        with self._cond:
            self._taken_ids.discard(message.message_id)


_http = urllib3.PoolManager(num_pools=16, retries=False)


def _urllib3_post(url: str, body: bytes, headers: dict[str, str], timeout_s: float) -> int:
    answer = _http.request("POST", url, body=body, headers=headers, redirect=False,
                           retries=False, preload_content=False,
                           timeout=urllib3.Timeout(connect=timeout_s, read=timeout_s))
    try:
        answer.read(65536)
    finally:
        answer.release_conn()
    return int(answer.status)
