"""The dispatcher's broker probe: while the broker is down it is asked again and again, but
says why only when the reason changes, and says once that the broker is back."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from ax_kombu.config import from_env
from ax_kombu.scheduler.dispatcher import Dispatcher
from ax_kombu.store import Store


@pytest.fixture
def dispatcher(tmp_path: Path) -> Iterator[Dispatcher]:
    cfg = from_env({}, database_url=f"sqlite:///{tmp_path / 'ax.sqlite3'}",
                   broker_url="memory://")
    store = Store(cfg)
    yield Dispatcher(cfg, store, "sched-unit", lambda ids: None)
    store.close()


def test_an_unreachable_broker_is_logged_once_per_cause_and_once_when_back(
        dispatcher: Dispatcher, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    errors: list[Exception | None] = [ConnectionRefusedError("refused")] * 5 + [
        TimeoutError("timed out")] * 3 + [None, None]

    def connect() -> None:
        error = errors.pop(0)
        if error is not None:
            raise error

    monkeypatch.setattr(dispatcher.publisher, "connect", connect)
    caplog.set_level(logging.INFO, logger="ax_kombu.scheduler.dispatcher")
    answers = [dispatcher.probe() for _ in range(10)]
    assert answers == [False] * 8 + [True, True]
    assert dispatcher.broker_ok.is_set()
    lines = [(r.levelname, r.getMessage(), getattr(r, "error", None)) for r in caplog.records
             if r.name == "ax_kombu.scheduler.dispatcher"]
    assert lines == [
        ("WARNING", "broker unreachable; due tasks wait for it", "ConnectionRefusedError('refused')"),
        ("WARNING", "broker unreachable; due tasks wait for it", "TimeoutError('timed out')"),
        ("INFO", "broker reachable again; dispatching", None),
    ]
