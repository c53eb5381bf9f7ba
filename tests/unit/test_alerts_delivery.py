"""Delivery of alert notifications (ax_kombu.alerts.delivery) to a real receiver on
loopback: signed per Standard Webhooks (checked with the ``standardwebhooks`` library),
retried with back-off under one ``webhook-id``, never blocking the sender, given up after
its tries."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any, ClassVar

import pytest
from standardwebhooks import Webhook, WebhookVerificationError

from ax_kombu.alerts import delivery as delivery_module
from ax_kombu.alerts.delivery import Delivery, Message
from ax_kombu.alerts.rules import new_secret

from ..loopback_http import serving
from ..waiting import eventually

pytestmark = pytest.mark.timeout(30)

SECRET = new_secret()


class _Receiver(BaseHTTPRequestHandler):
    """Answers 503 to the first ``failures`` requests, then 200; keeps what it got."""

    got: ClassVar[list[tuple[dict[str, str], bytes]]] = []
    failures: ClassVar[int] = 0
    stall: ClassVar[threading.Event] = threading.Event()

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers["Content-Length"]))
        if self.path == "/slow":
            self.stall.wait(10)
        self.got.append((dict(self.headers), raw))
        status = 503 if len(self.got) <= self.failures else 200
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[str]:
    _Receiver.got, _Receiver.failures = [], 0
    _Receiver.stall = threading.Event()
    with serving(_Receiver) as url:
        yield url
    _Receiver.stall.set()


def _message(url: str, n: int = 1) -> Message:
    return Message(url, SECRET, f"msg_test_{n}", {"type": "ax.alert.firing", "data": {"n": n}})


def test_a_message_is_signed_and_verifies_with_the_standard_library(receiver: str) -> None:
    sender = Delivery(backoff_s=0.05)
    sender.send(_message(f"{receiver}/hook"))
    eventually(lambda: sender.delivered == 1, timeout=5)
    headers, raw = _Receiver.got[0]
    assert Webhook(SECRET).verify(raw, headers) == {"type": "ax.alert.firing",
                                                    "data": {"n": 1}}
    assert headers["webhook-id"] == "msg_test_1"
    assert headers["content-type"] == "application/json"
    with pytest.raises(WebhookVerificationError, match="No matching signature"):
        Webhook(new_secret()).verify(raw, headers)
    sender.stop()


def test_a_failing_receiver_gets_the_same_message_again_until_it_takes_it(
        receiver: str) -> None:
    _Receiver.failures = 2
    sender = Delivery(backoff_s=0.05)
    sender.send(_message(f"{receiver}/hook"))
    eventually(lambda: sender.delivered == 1, timeout=5)
    assert len(_Receiver.got) == 3  # two 503s, then taken
    assert {h["webhook-id"] for h, _ in _Receiver.got} == {"msg_test_1"}
    for headers, raw in _Receiver.got:  # each try signed, each verifies
        Webhook(SECRET).verify(raw, headers)
    assert sender.pending() == 0 and sender.dropped == 0
    sender.stop()


def test_a_message_is_given_up_after_its_tries(receiver: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(delivery_module, "ATTEMPTS", 3)
    _Receiver.failures = 100
    sender = Delivery(backoff_s=0.02)
    sender.send(_message(f"{receiver}/hook"))
    eventually(lambda: sender.dropped == 1, timeout=5)
    assert len(_Receiver.got) == 3 and sender.delivered == 0 and sender.pending() == 0
    sender.stop()


def test_send_never_waits_on_a_stalled_receiver(receiver: str) -> None:
    sender = Delivery(backoff_s=0.05)
    started = time.monotonic()
    sender.send(_message(f"{receiver}/slow", 1))
    sender.send(_message(f"{receiver}/hook", 2))
    assert time.monotonic() - started < 0.2  # queued; the receiver stalls the thread only
    _Receiver.stall.set()
    eventually(lambda: sender.delivered == 2, timeout=5)
    bodies = [json.loads(raw)["data"]["n"] for _, raw in _Receiver.got]
    assert sorted(bodies) == [1, 2]
    sender.stop()


def test_an_unreachable_receiver_is_retried_then_dropped(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    monkeypatch.setattr(delivery_module, "ATTEMPTS", 2)
    sender = Delivery(backoff_s=0.02)
    sender.send(_message("http://127.0.0.1:9/closed"))  # discard port: refused
    eventually(lambda: sender.dropped == 1, timeout=10)
    assert sender.delivered == 0
    sender.stop()


class _Hooks:
    """Records what the sending thread tells the outbox; ``keep`` answers ``retrying``."""

    def __init__(self, keep: bool) -> None:
        self.keep = keep
        self.calls: list[tuple[str, str]] = []

    def delivered(self, message: Message) -> None:
        self.calls.append(("delivered", message.message_id))

    def retrying(self, message: Message, wait_s: float) -> bool:
        self.calls.append(("retrying", message.message_id))
        return self.keep

    def gave_up(self, message: Message) -> None:
        self.calls.append(("gave_up", message.message_id))


def test_the_outbox_is_told_of_retries_and_the_delivery(receiver: str) -> None:
    _Receiver.failures = 1
    sender = Delivery(backoff_s=0.05)
    sender.hooks = hooks = _Hooks(keep=True)
    sender.send(_message(f"{receiver}/hook"))
    sender.send(_message(f"{receiver}/hook"))  # the same id, queued already: not again
    eventually(lambda: sender.delivered == 1, timeout=5)
    assert hooks.calls == [("retrying", "msg_test_1"), ("delivered", "msg_test_1")]
    assert len(_Receiver.got) == 2
    sender.send(_message(f"{receiver}/hook"))  # delivered, no longer held: sent again
    eventually(lambda: sender.delivered == 2, timeout=5)
    sender.stop()


def test_a_message_another_scheduler_took_over_is_left_to_it(receiver: str) -> None:
    _Receiver.failures = 100
    sender = Delivery(backoff_s=0.02)
    sender.hooks = hooks = _Hooks(keep=False)
    sender.send(_message(f"{receiver}/hook"))
    eventually(lambda: sender.pending() == 0 and hooks.calls, timeout=5)
    time.sleep(0.2)  # room for a retry that must not come
    assert hooks.calls == [("retrying", "msg_test_1")] and len(_Receiver.got) == 1
    assert sender.delivered == 0
    sender.stop()


def test_a_message_given_up_is_told_to_the_outbox(receiver: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(delivery_module, "ATTEMPTS", 2)
    _Receiver.failures = 100
    sender = Delivery(backoff_s=0.02)
    sender.hooks = hooks = _Hooks(keep=True)
    sender.send(_message(f"{receiver}/hook"))
    eventually(lambda: sender.dropped == 1, timeout=5)
    assert hooks.calls == [("retrying", "msg_test_1"), ("gave_up", "msg_test_1")]
    sender.stop()
