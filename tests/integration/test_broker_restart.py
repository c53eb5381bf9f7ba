"""A broker that stops and comes back mid-run loses nothing.

Redis: a private redis-server of this test, stopped and started again on the
same port. The consumer here plays the worker's part of the contract
(DISPATCHING → RUNNING fenced by attempt), so anything lost in flight comes back
through the scheduler's ack timeout.

RabbitMQ's restart is the fault suite's (``tests/faults/test_faults.py::test_rabbitmq_restart``:
real daemons, a ledger, a private node). It is not repeated here: this test ran
``rabbitmqctl stop_app`` on the shared server, and whatever RabbitMQ test the other
pytest-xdist worker was running meanwhile saw its publishes fail.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import REGISTRY

from ax_kombu.api import Client
from ax_kombu.config import from_env

from ..services import unavailable
from ..waiting import eventually
from .harness import collecting, scheduler_running, starting

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_open(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
    except OSError:
        return False
    return True


def wait_port(port: int, up: bool, timeout: float = 30.0) -> None:
    eventually(lambda: port_open(port) == up, timeout,
               f"port {port} going {'up' if up else 'down'}", interval=0.05)


class PrivateRedis:
    def __init__(self, port: int) -> None:
        self.port = port
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(self.port, up=True)

    def stop(self) -> None:
        assert self.proc is not None
        self.proc.terminate()
        self.proc.wait(30)
        wait_port(self.port, up=False)


@pytest.fixture
def outage() -> Iterator[tuple[dict[str, str], Any, Any]]:
    """(broker settings, stop(), start()) for a private Redis this test may stop."""
    if shutil.which("redis-server") is None:
        unavailable("redis-server", "not installed (needed to run a private Redis)")
    server = PrivateRedis(free_port())
    server.start()
    yield ({"broker_url": f"redis://127.0.0.1:{server.port}/0"}, server.stop, server.start)
    if server.proc and server.proc.poll() is None:
        server.proc.terminate()


def failed_publishes() -> float:
    return REGISTRY.get_sample_value("ax_dispatch_total", {"result": "failed"}) or 0.0


def test_broker_outage_loses_nothing(pg_url: str, outage: tuple[dict[str, str], Any, Any]
                                     ) -> None:
    broker, stop, start = outage
    cfg = from_env({}, database_url=pg_url, heartbeat_interval_s=0.5, ack_timeout_ms=3000,
                   recovery_interval_s=0.5, republish_delay_ms=200, **broker)
    client = Client(cfg)
    ids = [int(i) for i in client.enqueue_many(
        [{"task_type": "t", "payload": {"i": i}, "delay": 0.5 + i / 100} for i in range(400)])]

    before = failed_publishes()
    with starting(client.store.engine) as start_task, collecting(cfg, start_task) as got, \
            scheduler_running(cfg):
        assert got.wait_for(lambda: len(got.got) >= 50)
        stop()
        time.sleep(1.0)  # deliberately keep the broker down while tasks fall due
        start()
        assert got.wait_for(lambda: _all_running(client, ids), timeout=90), \
            "some tasks never reached a worker after the broker came back"
    assert failed_publishes() > before  # the outage really hit publishing
    # published once per attempt: a repeat is only ever the broker redelivering a message
    # whose ack was lost with the connection (the worker's fencing refuses it)
    pairs = [(r.body["task_id"], r.body["attempt"]) for r in got.got if not r.redelivered]
    assert len(pairs) == len(set(pairs))
    assert set(got.ids()) == set(ids)
    client.close()


def _all_running(client: Client, ids: list[int]) -> bool:
    from sqlalchemy import func, select

    from ax_kombu.store.schema import tasks

    with client.store.engine.connect() as conn:
        n = conn.execute(select(func.count()).select_from(tasks).where(
            tasks.c.status == "RUNNING")).scalar_one()
    return int(n) == len(ids)



def test_a_worker_reconnects_when_the_broker_comes_back(
        pg_url: str, outage: tuple[dict[str, str], Any, Any]) -> None:
    from ax_kombu.broker.connection import connection, declare_queues
    from ax_kombu.core.states import Status

    from .test_worker import Dispatch, running

    broker, stop, start = outage
    cfg = from_env({}, database_url=pg_url, heartbeat_interval_s=0.2, **broker)
    with connection(cfg) as conn:
        declare_queues(conn, cfg)
    dispatch = Dispatch(cfg)

    def all_done(ids: list[int]) -> bool:
        return all(dispatch.status(i) is Status.SUCCESS for i in ids)

    try:
        before = [dispatch.enqueue("t.noop", {"i": i}) for i in range(5)]
        after = [dispatch.enqueue("t.noop", {"i": i}) for i in range(5, 10)]
        with running(cfg) as worker:
            dispatch.dispatch(before)
            eventually(lambda: all_done(before), what="tasks before the outage")
            stop()
            eventually(lambda: not worker.ready.is_set(), what="the worker saw the outage")
            start()
            eventually(worker.ready.is_set, timeout=60, what="the worker reconnected")
            dispatch.publisher.close()  # its connection died with the broker
            if broker["broker_url"].startswith("redis"):  # a fresh server: declare again
                with connection(cfg) as conn:
                    declare_queues(conn, cfg)
            dispatch.dispatch(after)
            eventually(lambda: all_done(after), timeout=60, what="tasks after the outage")
    finally:
        dispatch.close()
