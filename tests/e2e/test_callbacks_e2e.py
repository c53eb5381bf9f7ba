"""Callbacks through a real ``ax-worker`` process: an internal address is refused unless
listed, and a server that drips its answer keeps a pool slot no longer than the timeout."""

from __future__ import annotations

import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import ClassVar

import pytest

from ..loopback_http import serving
from .system import System

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.timeout(120)]


class _Server(BaseHTTPRequestHandler):
    """``/ok`` answers 200; ``/drip`` sends headers, then one byte a second for 30 s."""

    hits: ClassVar[list[str]] = []

    def do_POST(self) -> None:
        self.hits.append(self.path)
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Length", "30")
        self.end_headers()
        if self.path != "/drip":
            self.wfile.write(b"x" * 30)
            return
        for _ in range(30):
            try:
                self.wfile.write(b"x")
                self.wfile.flush()
            except OSError:
                return
            time.sleep(1)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    _Server.hits.clear()
    with serving(_Server) as url:
        yield url


def _system(pg_url: str, broker: dict[str, str], tmp: Path, **env: str) -> System:
    tmp.mkdir(parents=True, exist_ok=True)
    ax = System(pg_url, broker, tmp, env=env)
    ax.scheduler("sched-0")
    ax.worker("worker-0", concurrency="high=1,default=1,slow=1")
    ax.wait_ready()
    return ax


def test_an_internal_callback_is_refused_by_default_and_called_when_listed(
        pg_url: str, redis_broker: dict[str, str], tmp_path: Path, server: str) -> None:
    ax = _system(pg_url, redis_broker, tmp_path / "a")
    try:
        (refused,) = ax.enqueue_many([{"task_type": "cb", "callback_url": f"{server}/ok",
                                       "payload": {"n": 1}, "max_retry": 0}])
        ax.wait_final(1, 30)
        row = ax.tasks()[refused]
        assert row.status == "FAILED" and "refused" in row.last_error, row
        assert _Server.hits == []  # nothing was sent
    finally:
        ax.close()
    listed = _system(pg_url, redis_broker, tmp_path / "b", callback_allow_hosts="127.0.0.1")
    try:
        (called,) = listed.enqueue_many([{"task_type": "cb", "callback_url": f"{server}/ok",
                                           "payload": {"n": 2}}])
        listed.wait_for(lambda: listed.tasks()[called].status == "SUCCESS", 30, "called")
        assert _Server.hits == ["/ok"]
    finally:
        listed.close()


def test_a_dripping_server_frees_its_slot_within_the_timeout(
        pg_url: str, redis_broker: dict[str, str], tmp_path: Path, server: str) -> None:
    ax = _system(pg_url, redis_broker, tmp_path, callback_allow_hosts="127.0.0.1")
    try:
        (drip,) = ax.enqueue_many([{"task_type": "cb", "callback_url": f"{server}/drip",
                                    "timeout_ms": 1000, "max_retry": 0}])
        ax.wait_final(1, 30)
        row = ax.tasks()[drip]
        assert row.status == "FAILED", row
        assert row.finished_at - row.started_at < 1000 + 1000, row  # timeout + 1 s
        ax.wait_for(lambda: ax.node_info("worker-0").get("free", {}).get("default") == 1, 5,
                    "the default pool's only slot free again")
    finally:
        ax.close()
