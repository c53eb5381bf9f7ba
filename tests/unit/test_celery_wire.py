"""The Celery protocol-2 message ax builds by hand equals what Celery's own send_task builds,
and the Celery integration's pure parts (payload, times, beat schedules) — no servers."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from ax_kombu.broker.celery_wire import (
    MAX_HOLD_MS,
    celery_message,
    celery_redis_envelope,
    celery_task_id,
    due_groups,
    is_celery,
    iso_utc,
    processor_for,
    split_held,
)
from ax_kombu.broker.messages import RawJson, TaskMessage
from ax_kombu.exceptions import ValidationError

celery = pytest.importorskip("celery")

from ax_kombu.celery.beat import cron_of, job_spec
from ax_kombu.celery.producer import call_payload, when

TRIGGER = 1_800_000_000_000


def _message(payload: dict[str, Any], dispatched_at: int = TRIGGER + 3) -> TaskMessage:
    return TaskMessage(42, 3, "app.tasks.send", RawJson(json.dumps(payload)), "tr-1", TRIGGER,
                       60_000, "default", 0, 3, processor_for("mail"), None, dispatched_at,
                       "sched-1")


def _app() -> Any:
    return celery.Celery("wire", broker="memory://", set_as_current=False)


def test_marker_and_ids() -> None:
    assert is_celery("celery:mail") and not is_celery("mail") and not is_celery(None)
    assert celery_task_id(42, 3) == celery_task_id(42, 3) != celery_task_id(42, 4)
    assert celery_task_id(42, 3) != celery_task_id(43, 3)
    assert iso_utc(0) == "1970-01-01T00:00:00+00:00"


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


def test_eta_only_when_published_before_due() -> None:
    early = celery_message(_message({"args": [], "kwargs": {}}, dispatched_at=TRIGGER - 200))
    assert early.headers["eta"] == iso_utc(TRIGGER)
    assert datetime.fromisoformat(early.headers["eta"]).timestamp() * 1000 == TRIGGER
    for at in (TRIGGER, TRIGGER + 50):
        assert celery_message(_message({"args": [], "kwargs": {}}, at)).headers["eta"] is None


def test_early_celery_messages_are_held_until_due() -> None:
    """Only Celery-bound messages built before their trigger time are held; they come out
    in due groups, each stamped with the time it was released (so: no eta)."""
    def msg(i: int, trigger: int, celery: bool = True) -> TaskMessage:
        return _message({"args": [i], "kwargs": {}}, dispatched_at=TRIGGER - 250)._replace(
            task_id=i, trigger_time=trigger, processor=processor_for("q") if celery else "ax")

    batch = [msg(1, TRIGGER - 300), msg(2, TRIGGER - 100), msg(3, TRIGGER, celery=False),
             msg(4, TRIGGER + 100), msg(5, TRIGGER - 100)]
    now, held = split_held(batch)
    assert [m.task_id for m in now] == [1, 3] and [m.task_id for m in held] == [2, 4, 5]
    clock = [0.0]
    sleeps: list[float] = []

    def sleep(s: float) -> None:
        sleeps.append(s)
        clock[0] += s

    groups = list(due_groups(held, sleep=sleep, monotonic=lambda: clock[0]))
    assert [[m.task_id for m in g] for g in groups] == [[2, 5], [4]]
    assert [g[0].dispatched_at for g in groups] == [TRIGGER - 100, TRIGGER + 100]
    assert all(celery_message(m).headers["eta"] is None for g in groups for m in g)
    assert sum(sleeps) * 1000 == pytest.approx(350)
    # the hold is capped: what is still early then leaves with its eta
    far = [msg(6, TRIGGER + 5000)]
    clock[0] = 0.0
    (group,) = list(due_groups(far, sleep=sleep, monotonic=lambda: clock[0]))
    assert group[0].dispatched_at == TRIGGER - 250 + MAX_HOLD_MS
    assert celery_message(group[0]).headers["eta"] == iso_utc(TRIGGER + 5000)


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
