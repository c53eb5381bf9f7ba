"""Per-type alerts through real daemons: two ``ax-scheduler`` processes and an ``ax-worker``,
callback tasks that fail, and a local receiver that verifies every alert with the
``standardwebhooks`` library: one firing message for the incident and one resolve, whichever
scheduler sends them; the failing callbacks themselves arrive signed per Standard Webhooks.
A scheduler SIGKILLed while the receiver refuses its firing message: the other one delivers
it, under the same ``webhook-id``, once the dead one's takeover time on the outbox has passed."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any, ClassVar

import pytest
from standardwebhooks import Webhook

from ..loopback_http import serving
from .system import System

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.timeout(180)]

CALLBACK_SECRET = "cb-secret-for-e2e"


class _Receiver(BaseHTTPRequestHandler):
    """``/alerts`` keeps what it got (204; while ``refuse`` is set: 503, kept in
    ``refused``); ``/fail`` is a callback that answers 400."""

    alerts: ClassVar[list[tuple[dict[str, str], bytes]]] = []
    refused: ClassVar[list[tuple[dict[str, str], bytes]]] = []
    callbacks: ClassVar[list[tuple[dict[str, str], bytes]]] = []
    refuse: ClassVar[bool] = False
    lock = threading.Lock()

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        with self.lock:
            refused = self.path == "/alerts" and self.refuse
            kept = (self.refused if refused else self.alerts if self.path == "/alerts"
                    else self.callbacks)
            kept.append((dict(self.headers), raw))
        self.send_response(503 if refused else 204 if self.path == "/alerts" else 400)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[str]:
    _Receiver.alerts, _Receiver.refused, _Receiver.callbacks = [], [], []
    _Receiver.refuse = False
    with serving(_Receiver) as url:
        yield url


def test_two_schedulers_report_an_incident_once_and_its_end_once(
        pg_url: str, redis_broker: dict[str, str], tmp_path: Path, receiver: str) -> None:
    ax = System(pg_url, redis_broker, tmp_path,
                env={"alert_interval_ms": 200, "alert_quiet_ms": 3000,
                     "callback_allow_hosts": "127.0.0.1", "callback_secret": CALLBACK_SECRET})
    try:
        secret = ax.client.set_alert("cb.fail", on={"failed"}, webhook=f"{receiver}/alerts")
        ax.scheduler("sched-0")
        ax.scheduler("sched-1")
        ax.worker("worker-0", concurrency="high=2,default=2,slow=1")
        ax.wait_ready()
        ids = ax.enqueue_many([{"task_type": "cb.fail", "callback_url": f"{receiver}/fail",
                                "payload": {"n": n}, "max_retry": 0} for n in range(3)])
        ax.wait_final(3, 60)
        assert {r.status for r in ax.tasks().values()} == {"FAILED"}
        ax.wait_for(lambda: len(_Receiver.alerts) >= 2, 60, "a firing and a resolve",
                    detail=lambda: len(_Receiver.alerts))
        time.sleep(1.5)  # room for a duplicate from the other scheduler
        with _Receiver.lock:
            got = list(_Receiver.alerts)
        bodies = [Webhook(secret).verify(raw, headers) for headers, raw in got]
        assert [b["type"] for b in bodies] == ["ax.alert.firing", "ax.alert.resolved"]
        assert bodies[0]["data"]["task_type"] == "cb.fail"
        assert int(bodies[0]["data"]["sample_task_id"]) in ids
        assert bodies[1]["data"]["events"] == 3
        for headers, raw in _Receiver.callbacks:  # the callbacks: the standard signing
            Webhook(CALLBACK_SECRET.encode()).verify(raw, headers)
        assert len(_Receiver.callbacks) == 3
    finally:
        ax.close()


def test_a_firing_message_survives_the_scheduler_killed_before_delivering_it(
        pg_url: str, redis_broker: dict[str, str], tmp_path: Path, receiver: str) -> None:
    ax = System(pg_url, redis_broker, tmp_path,
                env={"alert_interval_ms": 200, "alert_quiet_ms": 600_000,
                     "alert_takeover_ms": 2000})
    try:
        secret = ax.client.set_alert("late.type", on="late", late_after="1s",
                                     webhook=f"{receiver}/alerts")
        _Receiver.refuse = True
        doomed = ax.scheduler("sched-0")
        ax.wait_ready()
        ax.enqueue_many([{"task_type": "late.type", "payload": {"n": 1}}])  # no worker: late
        ax.wait_for(lambda: _Receiver.refused, 30, "the firing message, refused")
        survivor = ax.scheduler("sched-1")  # started after sched-0 won the incident
        ax.wait_ready()
        ax.kill(doomed)  # dies with the message undelivered, the outbox still its own
        killed = time.monotonic()
        time.sleep(0.5)
        _Receiver.refuse = False
        ax.wait_for(lambda: _Receiver.alerts, 40, "the firing message delivered by sched-1",
                    detail=lambda: len(_Receiver.refused))
        assert time.monotonic() - killed < 40
        assert survivor.alive
        time.sleep(1.5)  # room for a duplicate
        with _Receiver.lock:
            got, refused = list(_Receiver.alerts), list(_Receiver.refused)
        [(headers, raw)] = got
        body = Webhook(secret).verify(raw, headers)
        assert body["type"] == "ax.alert.firing" and body["data"]["task_type"] == "late.type"
        assert {h["webhook-id"] for h, _ in refused} == {headers["webhook-id"]}
        assert ax.query("SELECT outbox FROM ax_alert")[0][0] is None  # taken out
        assert "alert outbox taken over" in survivor.log.read_text()
    finally:
        ax.close()
