"""The one task body every system in :mod:`bench.run` runs, and the ledger it writes.

The body takes the wall clock (``time.time_ns()``) first, then makes one Redis write::

    RPUSH <key> "<i> <due_ms> <start_ms>"

``i`` numbers the task (−1 for a warm-up), ``due_ms`` is the time it was due (epoch ms,
as the producer set it) and ``start_ms`` when the body started (epoch ms, three decimals).
Lateness is ``start_ms − due_ms`` for every system alike, whatever each records
elsewhere (ax's ``started_at`` of a staged task is its trigger time by construction).

The ledger's Redis URL and key come from ``AXBENCH_LEDGER_URL`` and ``AXBENCH_LEDGER_KEY``
in the process that runs the body (the ax worker, the Celery worker, the poller); the
connection is opened at import, so no task pays for it. It imports only redis-py, so no
system's process carries another's libraries.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import redis

URL_VAR = "AXBENCH_LEDGER_URL"
KEY_VAR = "AXBENCH_LEDGER_KEY"

_client: redis.Redis | None = None
_key = ""


def connect(url: str, key: str) -> None:
    """Point :func:`record` at the ledger ``key`` of the Redis at ``url`` (and connect now)."""
    global _client, _key
    _client = redis.Redis.from_url(url)
    _client.ping()
    _key = key


def configured() -> bool:
    """Whether :func:`connect` has pointed :func:`record` at a ledger."""
    return _client is not None


def record(i: int, due_ms: int) -> None:
    """The task body: one ``RPUSH`` of ``"<i> <due_ms> <start_ms>"`` to the ledger."""
    start_ns = time.time_ns()
    if _client is None:
        raise RuntimeError(f"no ledger: set {URL_VAR} and {KEY_VAR}")
    _client.rpush(_key, f"{i} {due_ms} {start_ns / 1e6:.3f}")


@dataclass(frozen=True)
class Entry:
    """One run of the body."""

    i: int
    due_ms: int
    start_ms: float

    @property
    def lateness_ms(self) -> float:
        return self.start_ms - self.due_ms


def read(client: redis.Redis, key: str) -> list[Entry]:
    """Every entry of the ledger ``key``, in the order they were written."""
    entries = []
    for raw in client.lrange(key, 0, -1):
        i, due, start = (raw.decode() if isinstance(raw, bytes) else raw).split()
        entries.append(Entry(int(i), int(due), float(start)))
    return entries


if os.environ.get(URL_VAR):
    connect(os.environ[URL_VAR], os.environ.get(KEY_VAR, "axbench:ledger"))
