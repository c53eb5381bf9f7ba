"""The Celery protocol-2 message ax builds by hand equals what Celery's own send_task builds,
the Celery integration's pure parts (payload, times, beat schedules), and the scheduler's
rule that a Celery-bound task is claimed only when due (never staged) while an ax task is
staged — no servers (SQLite on a temporary file, ax's SQLite transport)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from ax_kombu.api import Client
from ax_kombu.broker.celery_wire import (
    CeleryBound,
    CeleryFenced,
    celery_message,
    celery_redis_envelope,
    celery_task_id,
    processor_for,
)
from ax_kombu.broker.messages import ClaimedTask, RawJson
from ax_kombu.config import Settings, from_env
from ax_kombu.core.runners import CELERY, CELERY_AX, CELERY_AX_LEAD_MS, runner_of_route
from ax_kombu.exceptions import ValidationError
from ax_kombu.scheduler.node import Scheduler
from ax_kombu.store import preload
from ax_kombu.store.claims import claim, still_claimable

celery = pytest.importorskip("celery")

from ax_kombu.celery.beat import cron_of, job_spec
from ax_kombu.celery.handoff import CeleryHandOff
from ax_kombu.celery.producer import call_payload, when

TRIGGER = 1_800_000_000_000


def _message(payload: dict[str, Any], dispatched_at: int = TRIGGER + 3,
             kind: type[CeleryBound] = CeleryBound) -> CeleryBound:
    return kind(task_id=42, attempt=3, task_type="app.tasks.send",
                payload=RawJson(json.dumps(payload)), trace_id="tr-1", trigger_time=TRIGGER,
                timeout_ms=60_000, priority="default", retry_count=0, max_retry=3,
                processor=processor_for("mail"), callback_url=None,
                dispatched_at=dispatched_at, node="sched-1")


def _app() -> Any:
    return celery.Celery("wire", broker="memory://", set_as_current=False)


def test_marker_and_ids() -> None:
    # the marker names the runner a recurring job's occurrence is made with
    assert runner_of_route(processor_for("mail")) == CELERY
    assert runner_of_route(processor_for("mail", fenced=True)) == CELERY_AX
    assert runner_of_route("mail") is None and runner_of_route(None) is None
    assert celery_task_id(42, 3) == celery_task_id(42, 3) != celery_task_id(42, 4)
    assert celery_task_id(42, 3) != celery_task_id(43, 3)


def test_message_matches_celerys_own() -> None:
    """Every header, the body and the properties, as Celery's as_task_v2 makes them."""
    args, kwargs = ["a@b.c", 2], {"greeting": "hi", "n": [1, 2]}
    c = celery_message(_message({"args": args, "kwargs": kwargs}))
    task_id = celery_task_id(42, 3)
    theirs = _app().amqp.as_task_v2(task_id, "app.tasks.send", tuple(args), kwargs,
                                    origin="ax@sched-1")
    extra = {"ax_task_id": 42, "ax_attempt": 3, "trace_id": "tr-1"}
    ours_headers = {k: v for k, v in c.headers.items() if k not in extra}
    assert ours_headers == theirs.headers
    assert {k: c.headers[k] for k in extra} == extra
    assert json.loads(c.body) == json.loads(json.dumps(theirs.body))
    assert c.properties == theirs.properties
    assert c.queue == "mail"


def test_a_message_for_stock_workers_never_has_an_eta() -> None:
    """The scheduler hands a task for stock Celery workers over only when due (the staging
    tests below), so its message is never one a Celery worker must keep until its time."""
    for at in (TRIGGER - 200, TRIGGER, TRIGGER + 50):
        m = _message({"args": [], "kwargs": {}}, at)
        assert celery_message(m, now_ms=at).headers["eta"] is None


def test_a_fenced_message_staged_ahead_carries_its_trigger_time_as_celerys_eta() -> None:
    """Staged (runner 'celery_ax', the bootstep fences it): Celery's own eta = the trigger
    time, which Celery's Request reads back to the millisecond; once due, no eta."""
    from celery.worker.request import Request
    from kombu.transport.base import Message

    m = _message({"args": [1], "kwargs": {}}, TRIGGER - 900, CeleryFenced)
    c = celery_message(m, now_ms=TRIGGER - 900)
    assert datetime.fromisoformat(c.headers["eta"]) == datetime.fromtimestamp(TRIGGER / 1000,
                                                                               UTC)
    app = _app()

    def send(*args: Any) -> None:
        del args

    app.task(name="app.tasks.send", shared=False)(send)
    request = Request(Message(body=c.body.encode(), content_type="application/json",
                              content_encoding="utf-8", headers=c.headers,
                              properties=c.properties, delivery_info={}), app=app)
    assert request.eta is not None and request.eta.timestamp() * 1000 == TRIGGER
    for now in (TRIGGER, TRIGGER + 5):
        assert celery_message(m, now_ms=now).headers["eta"] is None


def test_options_reach_the_headers() -> None:
    c = celery_message(_message({"args": [], "kwargs": {}, "expires": "2030-01-01T00:00:00+00:00",
                                 "timelimit": [30, 20], "ignore_result": True}))
    assert c.headers["expires"] == "2030-01-01T00:00:00+00:00"
    assert c.headers["ignore_result"] is True
    assert c.headers["timelimit"] == [30, 20]


def test_redis_envelope_is_kombus() -> None:
    c = celery_message(_message({"args": [1], "kwargs": {}}))
    envelope = json.loads(celery_redis_envelope(c))
    assert json.loads(envelope["body"]) == [[1], {}, {"callbacks": None, "errbacks": None,
                                                      "chain": None, "chord": None}]
    assert envelope["headers"] == json.loads(json.dumps(c.headers))
    props = envelope["properties"]
    assert props["correlation_id"] == props["delivery_tag"] == celery_task_id(42, 3)
    assert props["delivery_info"] == {"exchange": "", "routing_key": "mail"}
    assert envelope["content-type"] == "application/json"


def test_call_payload() -> None:
    now = datetime(2030, 1, 1, tzinfo=UTC)
    assert call_payload((1, "a"), None) == {"args": [1, "a"], "kwargs": {}}
    full = call_payload([], {"x": 1}, expires=60, time_limit=5, ignore_result=True, now=now)
    assert full == {"args": [], "kwargs": {"x": 1}, "expires": "2030-01-01T00:01:00+00:00",
                    "timelimit": [5, None], "ignore_result": True}
    for bad in ({"args": "abc"}, {"args": [], "kwargs": [1]}):
        with pytest.raises(ValidationError):
            call_payload(bad["args"], bad.get("kwargs"))
    with pytest.raises(ValidationError):
        call_payload([], {}, expires=datetime(2030, 1, 1))  # naive


def test_when() -> None:
    app = _app()
    app.conf.timezone = "Asia/Shanghai"
    assert when(app, None, 30) == {"delay": 30.0}
    assert when(app, None, -5) == {"delay": 0.0}
    assert when(app, None, timedelta(minutes=1)) == {"delay": 60.0}
    assert when(app, None, None) == {}
    naive = when(app, datetime(2030, 1, 1, 8), None)["run_at"]
    assert naive == datetime(2030, 1, 1, 8, tzinfo=UTC)  # UTC, as Celery reads it
    assert when(app, "2030-01-01T00:00:00+00:00", None)["run_at"] == datetime(2030, 1, 1,
                                                                              tzinfo=UTC)
    with pytest.raises(ValidationError):
        when(app, datetime(2030, 1, 1, tzinfo=UTC), 5)
    with pytest.raises(ValidationError):
        when(app, "tomorrow", None)


def test_beat_entries() -> None:
    from celery.schedules import crontab, schedule, solar

    app = _app()
    app.conf.timezone = "Europe/Berlin"
    app.conf.task_routes = {"app.report": {"queue": "reports"}}
    name, task, payload, options = job_spec(app, "nightly", {
        "task": "app.report", "schedule": crontab(minute="*/15", hour="8-17",
                                                  day_of_week="mon-fri"),
        "args": (1,), "kwargs": {"k": "v"}})
    assert (name, task, payload) == ("nightly", "app.report", {"args": [1], "kwargs": {"k": "v"}})
    assert options == {"cron": "*/15 8-17 * * mon-fri", "tz": "Europe/Berlin",
                       "processor": "celery:reports"}
    assert cron_of("x", crontab(minute=0, hour=[1, 2])) == "0 1,2 * * *"
    for every in (30, timedelta(seconds=30), schedule(run_every=timedelta(seconds=30))):
        spec = job_spec(app, "e", {"task": "app.ping", "schedule": every,
                                   "options": {"queue": "q2"}})[3]
        assert spec["processor"] == "celery:q2"
        assert spec["every"] in (30, timedelta(seconds=30))
    for bad in (object.__new__(solar), crontab(day_of_month=1, day_of_week=1)):
        with pytest.raises(ValidationError):
            job_spec(app, "bad", {"task": "app.x", "schedule": bad})
    with pytest.raises(ValidationError):
        job_spec(app, "bad", {"schedule": 5})


def test_core_never_imports_celery() -> None:
    """``import ax_kombu`` and the daemons' modules work without Celery."""
    code = ("import sys, ax_kombu, ax_kombu.scheduler.node, ax_kombu.cli.scheduler, "
            "ax_kombu.cli.worker, ax_kombu.broker.publisher\n"
            "assert 'celery' not in sys.modules, sorted(m for m in sys.modules if 'celery' in m)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# -- staging: ax tasks are claimed up to claim_lead_ms early, Celery-bound ones when due ----

LEAD_MS = 300


@pytest.fixture
def cfg(tmp_path: Path) -> Settings:
    return from_env({}, database_url=f"sqlite:///{tmp_path / 'ax.sqlite3'}",
                    broker_url=f"ax+sqlite:///{tmp_path / 'broker.sqlite3'}",
                    heartbeat_interval_s=0.5, preload_window_ms=120_000,
                    claim_lead_ms=LEAD_MS)


@pytest.fixture
def client(cfg: Settings) -> Any:
    c = Client(cfg)
    yield c
    c.close()


def test_the_claim_takes_a_celery_bound_task_only_when_due(client: Client) -> None:
    """Claimed with a lead, an ax task due within it moves, a Celery-bound one does not; it
    fires ``claim_lead_ms`` late in the wheel's terms (preload, still_claimable), so when
    due."""
    plain = int(client.enqueue("plain", {"i": 1}, delay=0.1))
    bound = int(client.enqueue_to("celery", "app.tasks.x", {"args": [], "kwargs": {}},
                                  delay=0.1, processor=processor_for("q")))
    trigger = {i: client.get(i).trigger_time for i in (plain, bound)}
    now = min(trigger.values()) - 100
    with client.store.engine.begin() as conn:
        rows, _ = preload.preload(conn, preload.Loaded(), now + 10_000, 10,
                                   celery_lag_ms=LEAD_MS)
        assert dict(rows) == {plain: trigger[plain], bound: trigger[bound] + LEAD_MS}
        claimed = claim(conn, [plain, bound], "s1", now, due_before=now + LEAD_MS)
        assert [r.task_id for r in claimed] == [plain]
        assert still_claimable(conn, [plain, bound], claim_lead_ms=LEAD_MS) == [
            (bound, trigger[bound] + LEAD_MS, False)]
        assert claim(conn, [bound], "s1", trigger[bound] - 1, trigger[bound] + LEAD_MS) == []
        (row,) = claim(conn, [bound], "s1", trigger[bound], trigger[bound] + LEAD_MS)
        assert (row.task_id, row.attempt) == (bound, 1)


def test_a_task_for_bootstep_workers_is_staged_as_an_ax_task(client: Client) -> None:
    """Runner 'celery_ax' (the bootstep fences it at the due instant): handed to the wheel so
    that it fires CELERY_AX_LEAD_MS before its trigger time and claimed then; 'celery' still
    is not staged."""
    fenced = int(client.enqueue_to("celery_ax", "app.tasks.x", {"args": [], "kwargs": {}},
                                   delay=0.1, processor=processor_for("q", fenced=True)))
    stock = int(client.enqueue_to("celery", "app.tasks.x", {"args": [1], "kwargs": {}},
                                  delay=0.1, processor=processor_for("q")))
    trigger = {i: client.get(i).trigger_time for i in (fenced, stock)}
    now = min(trigger.values()) - 100
    with client.store.engine.begin() as conn:
        rows, _ = preload.preload(conn, preload.Loaded(), now + 10_000, 10,
                                   celery_lag_ms=LEAD_MS)
        assert dict(rows) == {fenced: trigger[fenced] + LEAD_MS - CELERY_AX_LEAD_MS,
                         stock: trigger[stock] + LEAD_MS}
        claimed = claim(conn, [fenced, stock], "s1", now, due_before=now + LEAD_MS)
        assert [(r.task_id, r.runner) for r in claimed] == [(fenced, "celery_ax")]


def test_the_publisher_holds_nothing() -> None:
    from ax_kombu.broker import publisher

    assert not hasattr(publisher, "split_held") and not hasattr(publisher, "due_groups")


def test_a_celery_bound_task_is_never_published_before_due_an_ax_task_still_is_staged(
        cfg: Settings, client: Client) -> None:
    """A scheduler node on the embedded store: each Celery-bound task is claimed and
    published at or after its trigger time on the database clock (here the store's
    clock, which SQLite shares with this process), ends SUCCESS at its hand-off, and its
    message has no eta; each ax task is claimed ahead of its trigger time, at most the lead."""
    n = 30
    bound = [int(client.enqueue_to("celery", "app.tasks.x", {"args": [i], "kwargs": {}},
                                   delay=0.5 + i / 50, processor=processor_for("celery")))
             for i in range(n)]
    plain = [int(i) for i in client.enqueue_many(
        [{"task_type": "plain", "payload": {"i": i}, "delay": 0.5 + i / 50} for i in range(n)])]
    published: list[tuple[ClaimedTask, int]] = []
    lock = threading.Lock()

    def seen(messages: list[ClaimedTask], _at_ms: int) -> None:
        db_now = client.store.now_ms()  # the database clock once the publish is over
        with lock:
            published.extend((m, db_now) for m in messages)

    scheduler = Scheduler(cfg, "sched-celery", on_published=seen, publish_hooks=(CeleryHandOff,))
    thread = threading.Thread(target=scheduler.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while len(published) < 2 * n and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        scheduler.request_stop()
        thread.join(30)
    assert not thread.is_alive()
    assert sorted(m.task_id for m, _ in published) == sorted(bound + plain)  # once each
    for m, db_now in published:
        if m.task_id in bound:
            assert m.dispatched_at >= m.trigger_time and db_now >= m.trigger_time
            assert celery_message(m).headers["eta"] is None
        else:
            # staged: at most the lead and the claim window ahead
            assert m.trigger_time - cfg.claim_reach_ms <= m.dispatched_at < m.trigger_time
    rows = {i: client.get(i) for i in bound}
    assert all(r.status.value == "SUCCESS" and r.dispatched_at is not None
               and r.dispatched_at >= r.trigger_time for r in rows.values())
