"""Fixtures of the fault suite, and its summary table at the end of the session.

The table is printed in the terminal summary and appended (with the date and the
commit) to ``$AX_FAULTS_SUMMARY``, by default ``ax-faults-summary.md`` in the
system's temporary directory.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from tests.e2e.system import REPO

from .cluster import Cluster
from .judge import RESULTS
from .proxy import TcpProxy
from .verdict import table


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


def _summary_path() -> Path:
    return Path(os.environ.get("AX_FAULTS_SUMMARY")
                or Path(tempfile.gettempdir()) / "ax-faults-summary.md")


def _commit() -> str:
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True,
                              capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    return done.stdout.strip() or "?"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not RESULTS:
        return
    text = table(RESULTS)
    path = _summary_path()
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%SZ")
    try:
        with open(path, "a") as out:
            out.write(f"\n## fault suite, {stamp}, commit {_commit()}\n\n{text}\n")
        where = f"(appended to {path})"
    except OSError as exc:
        where = f"(could not append to {path}: {exc})"
    terminalreporter.write_sep("=", "fault-injection summary")
    terminalreporter.write_line(text)
    terminalreporter.write_line(where)
