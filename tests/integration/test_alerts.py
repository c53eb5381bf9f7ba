"""Per-type alerts end to end below the daemon: tasks fail or start late in the store, the
scheduler's evaluator (ax_kombu.alerts.evaluator, driven here pass by pass with a short
quiet period) opens and closes incidents, and a local HTTP receiver verifies every message
with the ``standardwebhooks`` library. One message per incident and one resolve; with two
evaluators (two schedulers) at once, still one of each. On SQLite and PostgreSQL."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any, ClassVar

import pytest
from sqlalchemy import update
from standardwebhooks import Webhook

from ax_kombu.alerts.delivery import Delivery
from ax_kombu.alerts.evaluator import SETTLE_MS, Evaluator
from ax_kombu.api import Client
from ax_kombu.store import Store
from ax_kombu.store.schema import tasks

from ..loopback_http import serving
from .test_admin_cli import make

pytestmark = pytest.mark.timeout(120)

QUIET_MS = 2500


class _Receiver(BaseHTTPRequestHandler):
    got: ClassVar[list[tuple[dict[str, str], bytes]]] = []
    lock = threading.Lock()

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers["Content-Length"]))
        with self.lock:
            self.got.append((dict(self.headers), raw))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[str]:
    _Receiver.got = []
    with serving(_Receiver) as url:
        yield f"{url}/alerts"


def _verified(secret: str) -> list[dict[str, Any]]:
    """Every message received, each verified (raises if one is not), with its id."""
    with _Receiver.lock:
        got = list(_Receiver.got)
    out = []
    for headers, raw in got:
        body = Webhook(secret).verify(raw, headers)
        out.append({"id": headers["webhook-id"], **body})
    return out


class _Passes:
    """Runs evaluator passes (as the scheduler's timer does) until a condition holds."""

    def __init__(self, *evaluators: Evaluator) -> None:
        self.evaluators = evaluators

    def until(self, done: Callable[[], bool], timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, "timed out"
            for evaluator in self.evaluators:
                evaluator.run_once()
            time.sleep(0.05)

    def during(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        self.until(lambda: time.monotonic() >= end, seconds + 5)


@pytest.fixture
def evaluator(client: Client) -> Iterator[Evaluator]:
    delivery = Delivery(backoff_s=0.05)
    yield Evaluator(client.store, delivery, QUIET_MS)
    delivery.stop()


def _incident_row(client: Client) -> dict[str, Any]:
    return next(a for a in client.alerts() if a["task_type"] == "coupon.grant")


def test_failures_open_one_incident_and_a_quiet_period_resolves_it(
        client: Client, evaluator: Evaluator, receiver: str) -> None:
    secret = client.set_alert("coupon.grant", on={"failed"}, webhook=receiver)
    make(client, "other.type", "FAILED")  # not alerted
    make(client, "coupon.grant", "SUCCESS")
    first = make(client, "coupon.grant", "FAILED")
    passes = _Passes(evaluator)
    passes.until(lambda: len(_Receiver.got) == 1)
    [firing] = _verified(secret)
    assert firing["type"] == "ax.alert.firing"
    assert firing["data"]["task_type"] == "coupon.grant"
    assert firing["data"]["events"] == 1 and firing["data"]["failed"] == 1
    assert firing["data"]["sample_task_id"] == str(first)
    assert _incident_row(client)["opened_at"] is not None

    make(client, "coupon.grant", "FAILED")  # while open: counted, nothing sent
    make(client, "coupon.grant", "FAILED")
    passes.until(lambda: _incident_row(client)["events"] == 3)
    assert len(_Receiver.got) == 1

    passes.until(lambda: len(_Receiver.got) == 2, timeout=QUIET_MS / 1000 + 15)
    resolved = _verified(secret)[1]
    assert resolved["type"] == "ax.alert.resolved"
    assert resolved["data"]["events"] == 3
    assert resolved["data"]["opened_at"] == firing["data"]["opened_at"]
    assert resolved["id"] != firing["id"]
    assert _incident_row(client)["opened_at"] is None

    passes.during(1.0)  # quiet: nothing more
    assert len(_Receiver.got) == 2
    make(client, "coupon.grant", "FAILED")  # a new incident
    passes.until(lambda: len(_Receiver.got) == 3)
    again = _verified(secret)[2]
    assert again["type"] == "ax.alert.firing" and again["id"] not in {firing["id"],
                                                                      resolved["id"]}


def test_a_task_not_started_late_after_its_time_opens_an_incident(
        client: Client, evaluator: Evaluator, receiver: str) -> None:
    secret = client.set_alert("coupon.grant", on="late", late_after="1s", webhook=receiver)
    on_time = int(client.enqueue("coupon.grant", {"n": "on time"}, delay=0))
    waiting = int(client.enqueue("coupon.grant", {"n": "late"}, delay=0))
    with client.store.engine.begin() as conn:  # started 100 ms after its time, then done
        conn.execute(update(tasks).where(tasks.c.task_id == on_time).values(
            status="SUCCESS", started_at=tasks.c.trigger_time + 100,
            finished_at=tasks.c.trigger_time + 200))
    passes = _Passes(evaluator)
    passes.until(lambda: len(_Receiver.got) == 1)
    [firing] = _verified(secret)
    assert firing["data"]["late"] == 1 and firing["data"]["failed"] == 0
    assert firing["data"]["sample_task_id"] == str(waiting)
    assert firing["data"]["late_after_ms"] == 1000
    passes.during(1.5)  # the same late task is counted once
    assert _incident_row(client)["events"] == 1
    passes.until(lambda: len(_Receiver.got) == 2, timeout=QUIET_MS / 1000 + 15)
    assert _verified(secret)[1]["type"] == "ax.alert.resolved"


def test_two_schedulers_send_one_firing_and_one_resolve(
        client: Client, receiver: str) -> None:
    secret = client.set_alert("coupon.grant", on={"failed"}, webhook=receiver)
    stores = [Store(client.settings) for _ in range(2)]
    deliveries = [Delivery(backoff_s=0.05) for _ in stores]
    evaluators = [Evaluator(s, d, QUIET_MS) for s, d in zip(stores, deliveries, strict=True)]
    stop = threading.Event()

    def run(evaluator: Evaluator) -> None:
        while not stop.is_set():
            evaluator.run_once()
            time.sleep(0.01)

    threads = [threading.Thread(target=run, args=(e,), daemon=True) for e in evaluators]
    for t in threads:
        t.start()
    try:
        for _ in range(3):
            make(client, "coupon.grant", "FAILED")
        deadline = time.monotonic() + QUIET_MS / 1000 + 20
        while len(_Receiver.got) < 2:
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.05)
        time.sleep((SETTLE_MS + 500) / 1000)  # room for a duplicate to show up
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        for d in deliveries:
            d.stop()
        for s in stores:
            s.close()
    messages = _verified(secret)
    assert [m["type"] for m in messages] == ["ax.alert.firing", "ax.alert.resolved"]
    assert json.dumps(messages[1]["data"]["events"]) == "3"
