"""Per-type alerts end to end below the daemon: tasks fail or start late in the store, the
scheduler's evaluator (ax_kombu.alerts.evaluator, driven here pass by pass with a short
quiet period) opens and closes incidents, and a local HTTP receiver verifies every message
with the ``standardwebhooks`` library. One message per incident and one resolve; with two
evaluators (two schedulers) at once, still one of each. A message whose scheduler dies
before delivering it is delivered by another after its takeover time (the outbox), under the same
``webhook-id``. On SQLite and PostgreSQL."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any, ClassVar

import pytest
from sqlalchemy import select, update
from standardwebhooks import Webhook

from ax_kombu.alerts import delivery as delivery_module
from ax_kombu.alerts.delivery import Delivery
from ax_kombu.alerts.evaluator import SETTLE_MS, Evaluator
from ax_kombu.api import Client
from ax_kombu.store import Store
from ax_kombu.store.schema import alerts, tasks

from ..loopback_http import serving
from .test_admin_cli import make

pytestmark = pytest.mark.timeout(120)

QUIET_MS = 2500


class _Receiver(BaseHTTPRequestHandler):
    """Keeps what it accepts (204) in ``got``; while ``refuse`` is set, answers 503 and
    keeps the request in ``refused``."""

    got: ClassVar[list[tuple[dict[str, str], bytes]]] = []
    refused: ClassVar[list[tuple[dict[str, str], bytes]]] = []
    refuse: ClassVar[bool] = False
    lock = threading.Lock()

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers["Content-Length"]))
        with self.lock:
            refuse = self.refuse
            (self.refused if refuse else self.got).append((dict(self.headers), raw))
        self.send_response(503 if refuse else 204)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[str]:
    _Receiver.got, _Receiver.refused, _Receiver.refuse = [], [], False
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


TAKEOVER_MS = 1500
#: long enough that the incident stays open through a test of its firing message
LONG_QUIET_MS = 120_000


def _outbox(client: Client) -> tuple[list[dict[str, Any]], int | None]:
    """The undelivered messages of coupon.grant's alert, and their takeover time."""
    with client.store.engine.connect() as conn:
        row = conn.execute(select(alerts.c.outbox, alerts.c.outbox_claimed_until).where(
            alerts.c.task_type == "coupon.grant")).one()
    return (json.loads(row.outbox) if row.outbox else []), row.outbox_claimed_until


def _wait(done: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_firing_message_outlives_the_scheduler_that_won_it(
        client: Client, receiver: str) -> None:
    secret = client.set_alert("coupon.grant", on={"failed"}, webhook=receiver)
    _Receiver.refuse = True
    stores = [Store(client.settings) for _ in range(2)]
    deliveries = [Delivery(backoff_s=0.2) for _ in stores]
    first, second = (Evaluator(s, d, LONG_QUIET_MS, takeover_ms=TAKEOVER_MS)
                     for s, d in zip(stores, deliveries, strict=True))
    try:
        make(client, "coupon.grant", "FAILED")
        _Passes(first).until(lambda: len(_Receiver.refused) >= 2)  # refused, retried
        [entry], takeover = _outbox(client)  # the message waits in the outbox
        assert entry["kind"] == "firing" and takeover is not None
        assert takeover > client.store.now_ms()
        deliveries[0].stop()  # the first scheduler dies: its delivery is gone
        refused_ids = {h["webhook-id"] for h, _ in _Receiver.refused}
        assert refused_ids == {entry["id"]}

        _Receiver.refuse = False
        assert second.run_once() == 0  # not its takeover time yet: the second one waits
        time.sleep(0.3)
        assert _Receiver.got == []
        _Passes(second).until(lambda: len(_Receiver.got) == 1,
                              timeout=TAKEOVER_MS / 1000 + 15)
        _wait(lambda: _outbox(client)[0] == [])  # delivered: taken out of the outbox
        _Passes(second).during(1.0)  # and not sent again
        messages = _verified(secret)
        assert [m["id"] for m in messages] == [entry["id"]]
        assert messages[0]["type"] == "ax.alert.firing"
        assert messages[0]["data"] == entry["body"]["data"]
        assert len(_Receiver.got) == 1
    finally:
        for d in deliveries:
            d.stop()
        for s in stores:
            s.close()


def test_a_message_given_up_stays_in_the_outbox_and_is_tried_again(
        client: Client, receiver: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(delivery_module, "ATTEMPTS", 2)
    secret = client.set_alert("coupon.grant", on={"failed"}, webhook=receiver)
    _Receiver.refuse = True
    delivery = Delivery(backoff_s=0.05)
    evaluator = Evaluator(client.store, delivery, LONG_QUIET_MS, takeover_ms=TAKEOVER_MS)
    evaluator.outbox.given_up_ms = 3000
    try:
        make(client, "coupon.grant", "FAILED")
        _Passes(evaluator).until(lambda: delivery.dropped == 1)  # its 2 tries spent
        assert len(_Receiver.refused) == 2
        [entry], takeover = _outbox(client)  # kept, taken over later
        assert takeover is not None and takeover > client.store.now_ms() + TAKEOVER_MS
        _Receiver.refuse = False
        _Passes(evaluator).until(lambda: len(_Receiver.got) == 1, timeout=20)
        _wait(lambda: _outbox(client)[0] == [])
        [message] = _verified(secret)
        assert message["id"] == entry["id"] == _Receiver.refused[0][0]["webhook-id"]
    finally:
        delivery.stop()


def test_a_stopping_scheduler_hands_its_messages_over_at_once(
        client: Client, receiver: str) -> None:
    secret = client.set_alert("coupon.grant", on={"failed"}, webhook=receiver)
    _Receiver.refuse = True
    stores = [Store(client.settings) for _ in range(2)]
    deliveries = [Delivery(backoff_s=0.2) for _ in stores]
    first, second = (Evaluator(s, d, LONG_QUIET_MS, takeover_ms=60_000)
                     for s, d in zip(stores, deliveries, strict=True))
    try:
        make(client, "coupon.grant", "FAILED")
        _Passes(first).until(lambda: len(_Receiver.refused) >= 1)
        deliveries[0].stop()
        first.outbox.let_go()  # what the scheduler's alerting step does on a stop
        assert _outbox(client)[1] is None
        _Receiver.refuse = False
        _Passes(second).until(lambda: len(_Receiver.got) == 1, timeout=10)  # not 60 s
        [message] = _verified(secret)
        assert message["id"] == _Receiver.refused[0][0]["webhook-id"]
    finally:
        for d in deliveries:
            d.stop()
        for s in stores:
            s.close()
