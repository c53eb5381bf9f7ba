"""/healthz and /readyz of real daemons on their ``--metrics-port``, on PostgreSQL and Redis.

* A scheduler and a worker answer 200 on both once registered, and /metrics still serves
  the metrics; with their database cut off (a TCP proxy between them and PostgreSQL) both
  say 503 on /readyz with the reason (/healthz stays 200: their beats go on, failing), and
  200 again once the database is back.
* ``ax-worker --processes 2``: the supervisor serves the port. A child stopped by SIGSTOP
  past the silence window makes the supervisor's /healthz and /readyz 503, naming the
  child and its heartbeat's age; after SIGCONT both are 200 again.

Heartbeats every 0.3 s, a silence window of 0.9 s, so each case takes seconds.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ax_kombu.worker.supervisor import child_name

from ..faults.proxy import TcpProxy
from .system import Daemon, System

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.timeout(90)]

BEAT = {"heartbeat_interval_s": 0.3, "heartbeat_misses": 3}


@pytest.fixture
def system(pg_url: str, redis_broker: dict[str, str], tmp_path: Path) -> Iterator[System]:
    ax = System(pg_url, redis_broker, tmp_path, env=BEAT)
    yield ax
    ax.close()


@pytest.fixture
def proxy() -> Iterator[TcpProxy]:
    made = TcpProxy()
    yield made
    made.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def probe(port: int, path: str) -> tuple[int, dict[str, Any]]:
    """The status and the JSON answer of ``http://127.0.0.1:port/path`` ((0, {}) if the
    port does not answer yet)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as refused:
        return refused.code, json.loads(refused.read())
    except OSError:
        return 0, {}


def wait_answer(system: System, port: int, path: str, status: int,
                timeout: float = 20.0) -> dict[str, Any]:
    """Poll ``path`` until it answers ``status``; its answer."""
    last: list[tuple[int, dict[str, Any]]] = []

    def answered() -> dict[str, Any] | None:
        last[:] = [probe(port, path)]
        return last[0][1] if last[0][0] == status else None

    return system.wait_for(answered, timeout, f"{path} on :{port} answering {status}",  # type: ignore[no-any-return]
                           detail=lambda: last)


def metrics_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as answer:
        return answer.read().decode()


def start(system: System, kind: str, name: str, port: int, *args: str,
          env: dict[str, Any] | None = None) -> Daemon:
    settings = {"metrics_port": port, **(env or {})}
    if kind == "scheduler":
        return system.scheduler(name, env=settings)
    return system.worker(name, concurrency="high=2,default=2,slow=2", args=list(args),
                         env=settings)


def test_a_scheduler_and_a_worker_are_ready_and_unready_while_their_database_is_cut(
        proxy: TcpProxy, system: System, pg_url: str) -> None:
    through = {"database_url": proxy.url(pg_url)}
    ports = {"sched-p": free_port(), "work-p": free_port()}
    start(system, "scheduler", "sched-p", ports["sched-p"], env=through)
    start(system, "worker", "work-p", ports["work-p"], env=through)
    for name, port in ports.items():
        health = wait_answer(system, port, "/healthz", 200, 60)
        assert health["reason"].startswith("heartbeat "), health
        ready = wait_answer(system, port, "/readyz", 200)
        assert "database reachable" in ready["reason"], ready
        assert ("claiming" if name == "sched-p" else "consuming") in ready["reason"], ready
        assert f'ax_node_up{{kind="{"scheduler" if name == "sched-p" else "worker"}"}} 1.0' \
            in metrics_text(port)

    proxy.cut(120)
    for port in ports.values():
        cut = wait_answer(system, port, "/readyz", 503, 10)
        assert "database unreachable" in cut["reason"], cut
    # past the silence window the beats still go on, failing: live (a restart would not
    # bring the database back, and every node would restart at once), not ready
    past = time.monotonic() + 3 * 0.9
    while time.monotonic() < past:  # the silence window three times over, polled
        for port in ports.values():
            status, health = probe(port, "/healthz")
            assert status == 200 and health["reason"].startswith(
                "heartbeats going on, failing"), health
            status, ready = probe(port, "/readyz")
            assert status == 503 and ready["check"] in ("registered", "database"), ready

    proxy.cut(0)  # the database is back
    for port in ports.values():
        wait_answer(system, port, "/healthz", 200, 30)
        wait_answer(system, port, "/readyz", 200, 30)
    assert all(daemon.alive for daemon in system.daemons), system.tails()


def test_the_supervisor_answers_for_its_children_and_a_stopped_one_makes_it_unhealthy(
        system: System) -> None:
    port = free_port()
    supervisor = start(system, "worker", "wp", port, "--processes", "2")
    children = [child_name("wp", 1), child_name("wp", 2)]
    health = wait_answer(system, port, "/healthz", 200, 60)
    assert all(f"{name}: heartbeat" in health["reason"] for name in children), health
    wait_answer(system, port, "/readyz", 200)
    assert 'ax_node_up{kind="worker"} 2.0' in metrics_text(port)

    pid = int(system.node(children[0]).pid)
    assert pid != supervisor.proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        stale = wait_answer(system, port, "/healthz", 503, 10)
        assert stale["check"] == "children", stale
        assert stale["reason"].startswith(f"{children[0]}: no report for "), stale
        assert stale["reason"].endswith("(silence window 0.9 s)"), stale
        unready = wait_answer(system, port, "/readyz", 503, 5)
        assert children[0] in unready["reason"], unready
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_answer(system, port, "/healthz", 200, 20)
    wait_answer(system, port, "/readyz", 200, 20)
    assert supervisor.alive, system.tails()
