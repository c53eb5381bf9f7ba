"""Where the test servers are, and how a run isolates itself on each.

Every test run gets its own PostgreSQL database, its own Redis key prefix and
its own RabbitMQ vhost, named after RUN_ID, so two runs never see each
other. A server that cannot be reached skips its tests with the reason, or
fails them when ``AX_REQUIRE_SERVICES=1`` (as CI sets).
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NoReturn
from urllib.parse import urlsplit

import pytest

REQUIRE = os.environ.get("AX_REQUIRE_SERVICES") == "1"
PG_ADMIN_URL = os.environ.get("AX_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("AX_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
AMQP_URL = os.environ.get("AX_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
RUN_ID = f"{os.getpid()}_{secrets.token_hex(3)}"


def unavailable(what: str, why: object) -> NoReturn:
    """Skip (or, with AX_REQUIRE_SERVICES=1, fail) because ``what`` is unreachable."""
    if REQUIRE:
        pytest.fail(f"{what} is required (AX_REQUIRE_SERVICES=1) but unavailable: {why}",
                    pytrace=False)
    pytest.skip(f"{what} unavailable: {why}")


@contextmanager
def serving(what: str, start: Callable[[], object], stop: Callable[[], object]) -> Iterator[None]:
    """A server of the test's own for the ``with`` block: ``start()``; if that fails, ``stop()``
    and skip (fail with AX_REQUIRE_SERVICES=1) naming ``what``; ``stop()`` afterwards."""
    try:
        start()
    except (RuntimeError, OSError) as exc:
        stop()
        unavailable(what, exc)
    try:
        yield
    finally:
        stop()


def reachable(url: str, default_port: int) -> str | None:
    """None if a TCP connection to the URL's host succeeds, else the reason."""
    parts = urlsplit(url)
    try:
        socket.create_connection((parts.hostname or "127.0.0.1", parts.port or default_port),
                                 timeout=2).close()
    except OSError as exc:
        return f"{parts.hostname}:{parts.port or default_port}: {exc}"
    return None


def pg_url_for(database: str) -> str:
    parts = urlsplit(PG_ADMIN_URL)
    return parts._replace(path=f"/{database}").geturl()


def create_rabbit_vhost(name: str) -> str:
    """Create vhost ``name`` with guest's permissions; returns the broker URL for it."""
    ctl = shutil.which("rabbitmqctl")
    if ctl is None:
        unavailable("RabbitMQ", "rabbitmqctl not found (needed to create a test vhost)")
    for args in (["add_vhost", name], ["set_permissions", "-p", name, "guest", ".*", ".*", ".*"]):
        done = subprocess.run([ctl, *args], capture_output=True, text=True, timeout=60,
                              check=False)
        if done.returncode != 0:
            unavailable("RabbitMQ", f"rabbitmqctl {' '.join(args)}: {done.stderr.strip()}")
    return AMQP_URL.rstrip("/") + "/" + name


def delete_rabbit_vhost(name: str) -> None:
    ctl = shutil.which("rabbitmqctl")
    if ctl:
        subprocess.run([ctl, "delete_vhost", name], capture_output=True, timeout=60, check=False)


def own_queues(suffix: str) -> dict[str, str]:
    """Queue settings of their own: each ax queue's name with ``suffix``."""
    return {"queue_high": "high" + suffix, "queue_default": "default" + suffix,
            "queue_slow": "slow" + suffix}


def own_redis_broker(url: str, suffix: str) -> dict[str, str]:
    """Redis broker settings on ``url`` with queues (:func:`own_queues`) and a key prefix of
    their own; :func:`delete_redis_keys` with its ``broker_key_prefix`` cleans them up."""
    return {**own_queues(suffix), "broker_url": url,
            "broker_key_prefix": f"axtest:{RUN_ID}:high{suffix}:"}


def delete_redis_keys(url: str, prefix: str) -> None:
    """Delete every key under ``prefix`` (a test's or a module's own) from Redis at ``url``."""
    import redis

    client = redis.Redis.from_url(url)
    keys = list(client.scan_iter(match=prefix + "*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()
