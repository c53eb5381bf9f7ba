"""The worker's reconnect loop: the backoff doubles, and the cause is logged once per change."""

from __future__ import annotations

import logging

import pytest

from ax_kombu.worker.consumer import Outage

pytestmark = pytest.mark.timeout(30)


def warnings_and_infos(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records
            if r.name == "ax_kombu.worker.consumer" and r.levelno >= logging.INFO]


def test_the_cause_is_logged_once_per_change_and_the_reconnect_once(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    outage = Outage(clock=lambda: now[0])
    caplog.set_level(logging.DEBUG, logger="ax_kombu.worker.consumer")
    refused = ConnectionRefusedError(111, "Connection refused")
    pauses = [outage.failed(refused) for _ in range(3)]
    pauses.append(outage.failed(OSError("No route to host")))
    pauses.append(outage.failed(OSError("No route to host")))
    now[0] = 112.5
    outage.recovered()
    outage.recovered()  # already up: nothing more to say
    assert pauses == [0.5, 1.0, 2.0, 4.0, 8.0]
    assert warnings_and_infos(caplog) == [
        (logging.WARNING, "broker connection lost; reconnecting"),
        (logging.WARNING, "broker still unreachable, with another error; reconnecting"),
        (logging.INFO, "broker connection restored")]
    restored = [r for r in caplog.records if r.getMessage() == "broker connection restored"]
    assert restored[0].down_s == 12.5 and restored[0].attempts == 5
    assert sum(r.levelno == logging.DEBUG for r in caplog.records) == 3


def test_a_new_outage_is_logged_again_and_the_pause_stays_capped(
        caplog: pytest.LogCaptureFixture) -> None:
    outage = Outage(first_pause_s=4.0, max_pause_s=10.0)
    caplog.set_level(logging.INFO, logger="ax_kombu.worker.consumer")
    assert [outage.failed(OSError("down")) for _ in range(3)] == [4.0, 8.0, 10.0]
    outage.recovered()
    assert outage.failed(OSError("down")) == 10.0
    assert [m for _, m in warnings_and_infos(caplog)] == [
        "broker connection lost; reconnecting", "broker connection restored",
        "broker connection lost; reconnecting"]
