"""The Celery integration against real servers: calls stored in PostgreSQL, Celery messages
published to Redis and RabbitMQ and executed by Celery's own request code, the hand-off
recorded after the publish, and the recovery of an unconfirmed one."""

from __future__ import annotations

import dataclasses
import gc
import json
from collections.abc import Iterator
from typing import Any

import pytest
from kombu import Exchange, Queue
from sqlalchemy import text

from ax_kombu.api import Client
from ax_kombu.broker.celery_wire import celery_task_id, processor_for
from ax_kombu.broker.messages import ClaimedTask
from ax_kombu.broker.publisher import Publisher
from ax_kombu.config import Settings, from_env
from ax_kombu.exceptions import ValidationError
from ax_kombu.scheduler.dispatcher import to_message
from ax_kombu.store import preload, recovery
from ax_kombu.store.claims import claim

from .harness import consume

celery = pytest.importorskip("celery")

import ax_kombu.celery as axc
from ax_kombu.celery.handoff import CeleryHandOff

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

RUNS: list[tuple[Any, ...]] = []


def make_app(queue: str = "celery") -> Any:
    app = celery.Celery("ax_test_celery", broker="memory://", set_as_current=False)
    app.conf.task_default_queue = queue
    app.conf.task_routes = {"app.tasks.report": {"queue": "reports"}}

    @app.task(name="app.tasks.send_email", bind=True, shared=False)
    def send_email(self: Any, to: str, greeting: str = "hi") -> str:
        RUNS.append((self.request.id, to, greeting, self.request.get("ax_task_id")))
        return f"{greeting} {to}"

    @app.task(name="app.tasks.report", shared=False)
    def report(n: int) -> int:
        return n

    return app


@pytest.fixture
def client(pg_url: str) -> Iterator[Client]:
    c = Client(from_env({}, database_url=pg_url))
    yield c
    c.close()


def rows(client: Client) -> list[Any]:
    with client.store.engine.connect() as conn:
        return list(conn.execute(text("SELECT * FROM ax_task ORDER BY task_id")))


# -- producer side ---------------------------------------------------------------------------


def test_enqueue_stores_one_celery_bound_task(client: Client) -> None:
    app = make_app()
    task_id = axc.enqueue(app, "app.tasks.send_email", args=("a@b.c",), kwargs={"greeting": "yo"},
                          countdown=60, biz_key="welcome:1", client=client)
    assert task_id.created
    row = rows(client)[0]
    assert (row.task_type, row.processor_name, row.biz_key) == (
        "app.tasks.send_email", "celery:celery", "welcome:1")
    assert json.loads(row.payload) == {"args": ["a@b.c"], "kwargs": {"greeting": "yo"}}
    assert 59_000 <= row.trigger_time - row.created_at <= 61_000
    again = axc.enqueue(app, "app.tasks.send_email", args=("x@y.z",), countdown=5,
                        biz_key="welcome:1", client=client)
    assert again == task_id and not again.created  # biz_key: idempotent
    # the task's own queue, and an explicit one
    axc.enqueue(app, "app.tasks.report", args=(1,), countdown=5, client=client)
    axc.enqueue(app, "app.tasks.report", args=(2,), countdown=5, queue="other", client=client)
    assert [r.processor_name for r in rows(client)[1:]] == ["celery:reports", "celery:other"]


def test_bad_calls_write_nothing(client: Client) -> None:
    app = make_app()
    for kwargs in ({"args": "abc"}, {"kwargs": [1]}, {"args": (object(),)},
                   {"countdown": 5, "eta": "2030-01-01T00:00:00+00:00"}):
        with pytest.raises(ValidationError):
            axc.enqueue(app, "app.tasks.send_email", client=client, **kwargs)
    assert rows(client) == []


def test_install_routes_delayed_calls_to_ax_and_the_rest_to_celery(client: Client) -> None:
    app = make_app()
    send = app.tasks["app.tasks.send_email"]
    axc.install(app, client=client)
    axc.install(app, client=client)  # idempotent
    assert axc.installed(app)
    result = send.apply_async(("a@b.c",), countdown=1800)
    (row,) = rows(client)
    assert result.id == celery_task_id(row.task_id, 1)
    assert row.processor_name == "celery:celery" and row.task_type == "app.tasks.send_email"
    assert 1_799_000 <= row.trigger_time - row.created_at <= 1_801_000
    # the same call again within the dedup window: the same task
    assert send.apply_async(("a@b.c",), countdown=1800).id == result.id
    send.apply_async(("c@d.e",), eta="2030-01-01T00:00:00+00:00", ax_biz_key="k1")
    assert rows(client)[-1].biz_key == "k1"
    # no countdown, a link, an explicit id, a retry: Celery as before (memory broker)
    before = len(rows(client))
    send.delay("now@b.c")
    send.apply_async(("x",), countdown=5, task_id="mine")
    send.apply_async(("x",), countdown=5, link=send.s("y"))
    assert len(rows(client)) == before
    axc.uninstall(app)
    assert not axc.installed(app)
    send.apply_async(("z",), countdown=5)
    assert len(rows(client)) == before


# -- dispatch --------------------------------------------------------------------------------


def claimed_messages(client: Client, node: str = "sched-test") -> list[ClaimedTask]:
    """Claim every task now, as a scheduler would; their messages."""
    with client.store.engine.begin() as conn:
        now = client.store.now_ms() + 3_600_000
        ids = [r[0] for r in conn.execute(text("SELECT task_id FROM ax_task"))]
        claimed = claim(conn, ids, node, client.store.now_ms(), due_before=now)
    at = client.store.now_ms()
    return [to_message(r, node, at) for r in claimed]


def celery_consume(settings: Settings, queue: str, expected: int,
                   timeout: float = 20.0) -> list[Any]:
    """The raw messages on Celery queue ``queue``, declared as a Celery worker declares it."""
    q = Queue(queue, Exchange(queue), routing_key=queue, durable=True)
    return consume(settings, [q], expected, timeout)


def test_published_messages_run_in_celerys_own_request(client: Client,
                                                       broker: dict[str, str]) -> None:
    """Published by ax's publisher (Redis: pipelined LPUSH; RabbitMQ: confirms), read from
    the Celery queue, and executed by celery.worker.request.Request as a worker would."""
    from celery.worker.request import Request

    app = make_app(queue=f"celery.{broker['queue_high']}")
    queue = app.conf.task_default_queue
    ids = [axc.enqueue(app, "app.tasks.send_email", args=(f"u{i}@x",), client=client)
           for i in range(20)]
    messages = claimed_messages(client)
    assert len(messages) == 20
    settings = from_env({}, **broker)
    publisher = Publisher(settings)
    assert publisher.publish(messages) == []
    publisher.close()
    got = celery_consume(settings, queue, 20)
    assert len(got) == 20
    RUNS.clear()
    by_ax = {m.task_id: m for m in messages}
    for raw in got:
        ax_id = raw.headers["ax_task_id"]
        assert raw.headers["id"] == raw.properties["correlation_id"] == celery_task_id(
            ax_id, by_ax[ax_id].attempt)
        assert raw.headers["eta"] is None  # published when due
        request = Request(raw, app=app, task=app.tasks["app.tasks.send_email"])
        request.execute()
    assert sorted(r[3] for r in RUNS) == sorted(int(i) for i in ids)
    assert all(r[2] == "hi" and r[0] == celery_task_id(r[3], 1) for r in RUNS)


def test_a_celery_bound_task_is_claimed_only_when_due_and_cancel_wins_until_then(
        client: Client) -> None:
    """On PostgreSQL: the claim with a lead takes the ax task due within it, not the
    Celery-bound one (it reaches the wheel the lead late, so it fires when due); until
    its trigger time it is DELAYED, so a cancel wins and nothing is ever sent for it."""
    lead = 250
    app = make_app()
    bound = int(axc.enqueue(app, "app.tasks.send_email", args=("e@x",), countdown=0.2,
                            client=client))
    plain = int(client.enqueue("plain.task", {"x": 3}, delay=0.2))
    trigger = {r.task_id: r.trigger_time for r in rows(client)}
    now = min(trigger.values()) - 150
    node = "sched-test"
    with client.store.engine.begin() as conn:
        times = dict(preload.preload(conn, preload.Loaded(), now + 10_000, 100,
                                      celery_lag_ms=lead)[0])
        assert times == {bound: trigger[bound] + lead, plain: trigger[plain]}
        assert [r.task_id for r in claim(conn, [bound, plain], node, now, now + lead)] == [plain]
        assert claim(conn, [bound], node, trigger[bound] - 1, trigger[bound] + lead) == []
    assert client.get(bound).status.value == "DELAYED"
    client.cancel(bound)
    with client.store.engine.begin() as conn:
        assert claim(conn, [bound], node, trigger[bound], trigger[bound] + lead) == []
    assert client.get(bound).status.value == "CANCELLED"


# -- the hand-off and the recovery -----------------------------------------------------------


def test_hand_off_ends_celery_tasks_only_at_their_attempt(client: Client) -> None:
    app = make_app()
    ids = [axc.enqueue(app, "app.tasks.send_email", args=(f"h{i}",), client=client)
           for i in range(3)]
    plain = client.enqueue("plain.task", {"x": 1})
    messages = claimed_messages(client)
    stale = [dataclasses.replace(m, attempt=m.attempt + 1) for m in messages
             if m.task_id == ids[2]]
    seen: list[int] = []
    hooks = [CeleryHandOff(client.store), lambda ms, at: seen.append(len(ms))]
    at = client.store.now_ms()
    for hook in hooks:  # as the dispatcher calls its on_published hooks
        hook([m for m in messages if m.task_id != ids[2]] + stale, at)
    assert seen == [4]  # the next hook gets every message
    by_id = {r.task_id: r for r in rows(client)}
    for task_id in ids[:2]:
        row = by_id[task_id]
        assert (row.status, row.finished_at) == ("SUCCESS", at)
        assert json.loads(row.result) == {"celery_task_id": celery_task_id(task_id, 1),
                                          "celery_queue": "celery"}
    assert by_id[ids[2]].status == "DISPATCHING"  # a stale attempt moves nothing
    assert by_id[plain].status == "DISPATCHING"  # an ax task is the ax worker's
    assert client.get(ids[0]).result["celery_task_id"] == axc.async_result(app, ids[0]).id


def test_unconfirmed_celery_dispatch_is_sent_again_without_any_ax_worker(
        client: Client) -> None:
    app = make_app()
    task_id = axc.enqueue(app, "app.tasks.send_email", args=("r",), client=client)
    plain = client.enqueue("plain.task", {"x": 2})
    claimed_messages(client)
    later = client.store.now_ms() + 60_000
    with client.store.engine.begin() as conn:
        moved = recovery.redispatch_unacked(conn, later, 30_000, [], 5)
    assert moved == [(task_id, "READY")]  # the plain task waits for an ax worker's queue
    with client.store.engine.connect() as conn:  # and only it counts as waiting for one
        assert recovery.waiting_without_consumer(conn, ["default"]) == {"default": 1}
    assert {r.task_id: r.status for r in rows(client)} == {task_id: "READY",
                                                           plain: "DISPATCHING"}


def test_import_beat_schedule_makes_jobs(client: Client) -> None:
    from datetime import timedelta

    from celery.schedules import crontab

    app = make_app()
    app.conf.timezone = "Europe/Berlin"
    app.conf.beat_schedule = {
        "reports.nightly": {"task": "app.tasks.report", "schedule": crontab(minute=30, hour=2),
                            "args": (7,)},
        "mail.ping": {"task": "app.tasks.send_email", "schedule": timedelta(seconds=30),
                      "kwargs": {"to": "ops@x"}},
    }
    jobs = axc.import_beat_schedule(app, client=client, prefix="beat:")
    assert [j.name for j in jobs] == ["beat:reports.nightly", "beat:mail.ping"]
    again = axc.import_beat_schedule(app, client=client, prefix="beat:")  # idempotent
    assert [j.name for j in again] == [j.name for j in jobs]
    fires = client.next_fires("beat:reports.nightly", 2)
    assert all((f.hour, f.minute) == (2, 30) for f in fires)
    with client.store.engine.connect() as conn:
        stored = {r.name: r for r in conn.execute(text("SELECT * FROM ax_job"))}
    assert stored["beat:reports.nightly"].processor_name == processor_for("reports")
    assert json.loads(stored["beat:mail.ping"].payload) == {"args": [], "kwargs": {"to": "ops@x"}}


# -- the worker extension (AxBootstep) ------------------------------------------------------


def test_bootstep_fences_records_and_refuses(client: Client, redis_broker: dict[str, str],
                                             pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the bootstep: RUNNING before the body, SUCCESS (with the return value) after;
    the same message again is refused without running the body; a failure retries with
    ax's backoff; no hand-off is recorded for fenced tasks; the worker is an ax node."""
    from types import SimpleNamespace

    from celery.worker.request import Request

    monkeypatch.setenv("AX_DATABASE_URL", pg_url)
    app = make_app(queue=f"celery.{redis_broker['queue_high']}")

    @app.task(name="app.tasks.boom", shared=False)
    def boom() -> None:
        raise ValueError("boom")

    app.steps["worker"].add(axc.AxBootstep)
    assert axc.uses_bootstep(app)
    step = axc.AxBootstep(SimpleNamespace(app=app, hostname="w1@test"))
    thresholds = gc.get_threshold()
    step.start(SimpleNamespace(app=app))
    try:
        # the collector: what exists at start frozen, the oldest generation collected at
        # every collection of the middle one (Celery's ETA path leaves cycles per task)
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (thresholds[0], thresholds[1], 1)
        ok = axc.enqueue(app, "app.tasks.send_email", args=("f@x",), client=client)
        bad = axc.enqueue(app, "app.tasks.boom", client=client)
        assert {r.processor_name for r in rows(client)} == {
            f"celery+ax:{app.conf.task_default_queue}"}
        messages = claimed_messages(client)
        CeleryHandOff(client.store)(messages, client.store.now_ms())  # not for fenced tasks
        assert {r.status for r in rows(client)} == {"DISPATCHING"}
        settings = from_env({}, **redis_broker)
        publisher = Publisher(settings)
        assert publisher.publish(messages) == []
        publisher.close()
        raw = {m.headers["ax_task_id"]: m for m in celery_consume(
            settings, app.conf.task_default_queue, 2)}
        RUNS.clear()
        Request(raw[ok], app=app, task=app.tasks["app.tasks.send_email"]).execute()
        assert step.fence.flush(10)  # ends are written in batches off the pool thread
        row = client.get(ok)
        assert (row.status, row.result, row.owner_node) == ("SUCCESS", "hi f@x",
                                                               "celery@w1@test")
        assert len(RUNS) == 1
        Request(raw[ok], app=app, task=app.tasks["app.tasks.send_email"]).execute()
        assert len(RUNS) == 1  # refused: the attempt is not DISPATCHING any more
        Request(raw[bad], app=app, task=app.tasks["app.tasks.boom"]).execute()
        assert step.fence.flush(10)
        failed = client.get(bad)
        assert (failed.status, failed.retry_count) == ("DELAYED", 1)
        assert "ValueError: boom" in (failed.last_error or "")
        assert [a.outcome for a in failed.attempts] == ["RETRY"]
        with client.store.engine.connect() as conn:
            node = conn.execute(text("SELECT * FROM ax_node WHERE node_id = 'celery@w1@test'")
                                ).one()
        assert node.stopped_at is None and node.kind == "worker"
        # a direct call outside a worker passes through
        assert app.tasks["app.tasks.send_email"]("d@x") == "hi d@x"
    finally:
        step.fence.unregister()
        gc.set_threshold(*thresholds)  # this test process, not a worker: as it was
        gc.unfreeze()
