"""Fixtures of the fault suite (its summary table: :mod:`tests.faults.summary`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .cluster import Cluster
from .proxy import TcpProxy


@pytest.fixture
def proxy() -> Iterator[TcpProxy]:
    """A TCP proxy to the shared PostgreSQL that the test can cut."""
    p = TcpProxy()
    yield p
    p.close()


@pytest.fixture
def cluster(pg_url: str, redis_broker: dict[str, str], tmp_path: Path) -> Iterator[Cluster]:
    """A cluster (not started) on this test's database and Redis queues."""
    c = Cluster(pg_url, redis_broker, tmp_path)
    yield c
    c.close()


@pytest.fixture
def proxied_cluster(pg_url: str, redis_broker: dict[str, str], tmp_path: Path,
                    proxy: TcpProxy) -> Iterator[Cluster]:
    """A cluster whose daemons reach PostgreSQL through ``proxy``."""
    c = Cluster(pg_url, redis_broker, tmp_path, daemon_database_url=proxy.url(pg_url))
    yield c
    c.close()
