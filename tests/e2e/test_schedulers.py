"""Two real ``ax-scheduler`` processes on PostgreSQL + Redis: exactly once per attempt.

A scheduler killed with SIGKILL is the fault suite's (tests/faults/test_faults.py
``test_sigkill_a_scheduler``: nothing lost, no attempt run twice, under a steady load)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import func, select

from ax_kombu.api import Client
from ax_kombu.config import Settings, from_env
from ax_kombu.store.schema import nodes, tasks

from ..integration.harness import Received, collecting, starting
from ..waiting import wait_until
from .system import stop_all

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.timeout(240)]

N = 5000


def env_for(cfg: Settings) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"AX_DATABASE_URL": cfg.database_url, "AX_BROKER_URL": cfg.broker_url,
                "AX_BROKER_KEY_PREFIX": cfg.broker_key_prefix, "AX_QUEUE_HIGH": cfg.queue_high,
                "AX_QUEUE_DEFAULT": cfg.queue_default, "AX_QUEUE_SLOW": cfg.queue_slow,
                "AX_HEARTBEAT_INTERVAL_S": "0.5", "AX_ACK_TIMEOUT_MS": "15000",
                "AX_RECOVERY_INTERVAL_S": "1"})
    return env


@pytest.fixture
def cfg(pg_url: str, redis_broker: dict[str, str]) -> Settings:
    return from_env({}, database_url=pg_url, **redis_broker)


def start_schedulers(cfg: Settings, tmp: Path, count: int) -> list[subprocess.Popen[bytes]]:
    procs = []
    for i in range(count):
        log = open(tmp / f"scheduler{i}.log", "wb")  # noqa: SIM115 - lives as long as the process
        procs.append(subprocess.Popen(
            [sys.executable, "-c", "from ax_kombu.cli.scheduler import main; main()",
             "-n", f"sched-{i}", "-l", "INFO"], env=env_for(cfg), stdout=log, stderr=log))
    return procs


@pytest.fixture
def running(cfg: Settings, tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    procs = start_schedulers(cfg, tmp_path, 2)
    yield procs
    stop_all(procs)


def count(client: Client, status: str | None = None, table: object = tasks) -> int:
    stmt = select(func.count()).select_from(table)  # type: ignore[arg-type]
    if status is not None:
        stmt = stmt.where(tasks.c.status == status)
    with client.store.engine.connect() as conn:
        return int(conn.execute(stmt).scalar_one())


def schedulers(client: Client) -> int:
    with client.store.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(nodes)
                                .where(nodes.c.kind == "scheduler")).scalar_one())


def run_burst(cfg: Settings, client: Client) -> list[Received]:
    with starting(client.store.engine) as start_task, collecting(cfg, start_task) as got:
        assert wait_until(lambda: schedulers(client) == 2, 60), "schedulers did not start"
        client.enqueue_many([{"task_type": "burst", "payload": {"i": i},
                              "delay": 1 + 3 * i / N} for i in range(N)])
        assert got.wait_for(lambda: count(client, "RUNNING") == N, timeout=120), \
            f"only {count(client, 'RUNNING')} of {N} tasks were dispatched"
    return got.got


def assert_once_per_attempt(received: list[Received]) -> None:
    pairs = [(r.body["task_id"], r.body["attempt"]) for r in received if not r.redelivered]
    assert len(pairs) == len(set(pairs)), "a task attempt was published twice"


def test_two_schedulers_publish_every_task_exactly_once(
        cfg: Settings, running: list[subprocess.Popen[bytes]]) -> None:
    client = Client(cfg)
    received = run_burst(cfg, client)
    assert_once_per_attempt(received)
    assert len(received) == N  # no re-dispatch was needed: exactly one message per task
    with client.store.engine.connect() as conn:
        by_node = dict(conn.execute(select(tasks.c.owner_node, func.count())
                                    .group_by(tasks.c.owner_node)).all())
    assert sum(by_node.values()) == N
    client.close()
