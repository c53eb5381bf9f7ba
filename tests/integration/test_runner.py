"""Where a task runs is stored (``ax_task.runner``), not read from a ``celery:`` prefix
(issue 22 item 2): enqueue, the claim, a message that cannot be built, migration 0009.
On SQLite and PostgreSQL (the ``store_url`` fixture)."""

from __future__ import annotations

from typing import Any

import pytest
from kombu import Connection, Queue
from sqlalchemy import Engine, text

from ax_kombu.api import Client
from ax_kombu.broker.celery_wire import CeleryBound, processor_for
from ax_kombu.broker.messages import RawJson, TaskMessage
from ax_kombu.broker.publisher import Publisher
from ax_kombu.config import Settings, from_env
from ax_kombu.core.states import Status
from ax_kombu.exceptions import ValidationError
from ax_kombu.scheduler.dispatcher import Dispatcher
from ax_kombu.store import jobs as job_store
from ax_kombu.store import preload, recovery
from ax_kombu.store.claims import claim
from ax_kombu.store.engine import migrate
from ax_kombu.store.schema import task_archive

pytestmark = [pytest.mark.timeout(120)]

LEAD_MS = 400


def runner_of(client: Client, task_id: int) -> str:
    with client.store.engine.connect() as conn:
        return str(conn.execute(text("SELECT runner FROM ax_task WHERE task_id = :id"),
                                {"id": int(task_id)}).scalar_one())


def count(client: Client) -> int:
    with client.store.engine.connect() as conn:
        return int(conn.execute(text("SELECT COUNT(*) FROM ax_task")).scalar_one())


# -- enqueue -------------------------------------------------------------------------------


@pytest.mark.parametrize("task_type, options", [
    ("celery:cleanup", {}),                               # the task type is the processor
    ("cleanup", {"processor": "celery:cleanup"}),
    ("cleanup", {"processor": "celery+ax:cleanup"}),
    ("cleanup", {"processor": "CELERY:cleanup"}),
    ("cleanup", {"processor": "celery+x"}),
])
def test_enqueue_refuses_a_celery_route_and_stores_nothing(client: Client, task_type: str,
                                                           options: dict[str, Any]) -> None:
    with pytest.raises(ValidationError, match="looks like a Celery route.*ax_kombu.celery"):
        client.enqueue(task_type, {"args": [], "kwargs": {}}, **options)
    with pytest.raises(ValidationError, match="Celery route"):
        client.enqueue_many([{"task_type": "fine", "payload": {}},
                             {"task_type": task_type, "payload": "x", **options}])
    assert count(client) == 0


def test_the_runner_is_stored_at_enqueue(client: Client) -> None:
    plain = client.enqueue("celery.like.name", {"n": 1}, processor="celeryish")
    hook = client.enqueue("hook", {}, callback_url="http://127.0.0.1:9/x")
    bound = client.enqueue_to("celery", "app.tasks.x", {"args": [], "kwargs": {}},
                              processor=processor_for("q"))
    fenced = client.enqueue_to("celery_ax", "app.tasks.y", {"args": [], "kwargs": {}},
                               processor=processor_for("q", fenced=True))
    assert [runner_of(client, i) for i in (plain, hook, bound, fenced)] == [
        "ax", "callback", "celery", "celery_ax"]
    assert client.get(bound).runner == "celery"
    with pytest.raises(ValidationError, match="runner must be one of"):
        client.enqueue_to("ax", "t", {}, processor=processor_for("q"))
    with pytest.raises(ValidationError, match="needs processor 'celery:<queue>'"):
        client.enqueue_to("celery", "t", {}, processor="plain")
    assert count(client) == 4


# -- the claim, the preload and recovery read the stored runner ------------------------------


def _rename(client: Client, task_id: int, processor: str) -> None:
    with client.store.engine.begin() as conn:
        conn.execute(text("UPDATE ax_task SET processor_name = :p WHERE task_id = :id"),
                     {"p": processor, "id": int(task_id)})


def test_the_claim_reads_the_stored_runner_not_the_name(client: Client) -> None:
    """An ax task named like a Celery route is staged as an ax task (claimed ahead, counted
    as waiting for an ax worker); a Celery-bound task whose name says nothing is still
    claimed only when due and left to Celery's recovery rule."""
    named = int(client.enqueue("t", {"i": 1}, processor="cleanup", delay=0.2))
    _rename(client, named, "celery:cleanup")  # a name, not a route
    bound = int(client.enqueue_to("celery", "app.tasks.x", {"args": [], "kwargs": {}},
                                  delay=0.2, processor=processor_for("q")))
    trigger = {i: client.get(i).trigger_time for i in (named, bound)}
    now = min(trigger.values()) - 100
    with client.store.engine.begin() as conn:
        times = dict(preload.preload(conn, preload.Loaded(), now + 10_000, 10,
                                      celery_lag_ms=LEAD_MS)[0])
        assert times == {named: trigger[named], bound: trigger[bound] + LEAD_MS}
        claimed = claim(conn, [named, bound], "s1", now, due_before=now + LEAD_MS)
        assert [(r.task_id, r.runner) for r in claimed] == [(named, "ax")]
        waiting = recovery.waiting_without_consumer(conn, ["default"])
        assert waiting == {"default": 1}  # the ax task; never the Celery-bound one
        (row,) = claim(conn, [bound], "s1", trigger[bound], trigger[bound] + LEAD_MS)
        assert (row.task_id, row.runner) == (bound, "celery")


def test_an_occurrence_takes_the_runner_its_job_was_written_for(client: Client) -> None:
    """ax_job stores no runner: an occurrence of a job that ax_kombu.celery's beat import
    wrote (processor celery:<queue>) is Celery-bound, any other one runs on ax."""
    base = {"task_type": "t", "trigger_time": 1, "status": "CREATED", "priority": "default",
            "retry_count": 0, "max_retry": 0, "timeout_ms": 1000, "payload": "{}",
            "biz_key": None, "fingerprint": "f", "trace_id": "x", "attempt": 0,
            "created_at": 1, "callback_url": None, "job": "j"}
    rows = [dict(base, task_id=1, processor_name="celery:q", scheduled_at=1),
            dict(base, task_id=2, processor_name="celery+ax:q", scheduled_at=2),
            dict(base, task_id=3, processor_name="p", scheduled_at=3),
            dict(base, task_id=4, processor_name=None, callback_url="http://h/x", scheduled_at=4)]
    with client.store.engine.begin() as conn:
        assert job_store.insert_occurrences(conn, rows) == [1, 2, 3, 4]
    assert [runner_of(client, i) for i in (1, 2, 3, 4)] == ["celery", "celery_ax", "ax",
                                                            "callback"]


# -- a message that cannot be built ----------------------------------------------------------


def test_the_publisher_refuses_an_unbuildable_message_alone() -> None:
    settings = from_env({}, broker_url="memory://", database_url="sqlite://")
    good = TaskMessage(1, 1, "t", RawJson("{}"), "tr", 0, 1000, "default", 0, 0, "t", None, 0,
                       "s")
    bad, ok = (CeleryBound(task_id=task_id, attempt=1, task_type="app.x",
                           payload=RawJson(payload), trace_id="tr", trigger_time=0,
                           timeout_ms=1000, priority="default", retry_count=0, max_retry=0,
                           processor=processor_for("q"), callback_url=None, dispatched_at=0,
                           node="s")
               for task_id, payload in ((2, '"not an object"'), (3, '{"args": [1]}')))
    publisher = Publisher(settings)
    try:
        sent = publisher.send([good, bad, ok])
        assert sent.failed == []
        assert [(m.task_id, r) for m, r in sent.refused] == [
            (2, ("cannot build the Celery message: a Celery task's payload must be an object "
                 '{"args": [...], "kwargs": {...}}, got str'))]
        assert publisher.publish([bad]) == [bad]  # publish(): refused counts as not sent
        with Connection("memory://") as conn:
            got = [Queue(q)(conn.default_channel).get(no_ack=True)
                   for q in (settings.queue_for("default"), "q")]
        assert got[0] is not None and got[0].payload["task_id"] == 1
        assert got[1] is not None and got[1].headers["ax_task_id"] == 3
    finally:
        publisher.close()


def test_an_unbuildable_message_fails_its_task_and_the_batch_is_published(
        settings: Settings, client: Client) -> None:
    plain = [int(i) for i in client.enqueue_many(
        [{"task_type": "t", "payload": {"i": i}} for i in range(5)])]
    bad = int(client.enqueue_to("celery", "app.tasks.cleanup", "not an object",
                                processor=processor_for("cleanup")))
    good = int(client.enqueue_to("celery", "app.tasks.send", {"args": [1], "kwargs": {}},
                                 processor=processor_for("mail")))
    ids = [*plain, bad, good]
    now = client.store.now_ms() + 1000
    with client.store.engine.begin() as conn:
        rows = claim(conn, ids, "s1", now)
    assert len(rows) == len(ids)
    returned: list[list[int]] = []
    dispatcher = Dispatcher(settings, client.store, "s1", returned.append)
    try:
        dispatcher._publish(rows)
    finally:
        dispatcher.publisher.close()
    assert returned == [] and dispatcher.published == len(ids) - 1
    view = client.get(bad)
    assert view.status is Status.FAILED and view.finished_at is not None
    assert view.last_error is not None and "payload must be an object" in view.last_error
    assert {client.get(i).status for i in plain + [good]} == {Status.DISPATCHING}


# -- migration 0009 ------------------------------------------------------------------------


def test_migration_0009_backfills_the_runner_from_the_prefix_rule(empty_store: Engine) -> None:
    migrate(empty_store, "0008")
    base = {"task_type": "t", "trigger_time": 1, "status": "DELAYED", "priority": "default",
            "retry_count": 0, "max_retry": 0, "timeout_ms": 1000, "payload": "{}",
            "fingerprint": "f", "trace_id": "x", "attempt": 0, "created_at": 1,
            "redispatches": 0, "gated": False}
    named = {1: ("celery:q", None), 2: ("celery+ax:q", None), 3: ("plain", None),
             4: (None, "http://127.0.0.1/x"), 5: ("celeryish", None)}
    rows = [{**base, "task_id": i, "processor_name": p, "callback_url": c}
            for i, (p, c) in named.items()]
    columns = ", ".join(rows[0])
    values = ", ".join(":" + k for k in rows[0])
    with empty_store.begin() as conn:  # as written before 0009: no runner column
        conn.execute(text(f"INSERT INTO ax_task ({columns}) VALUES ({values})"), rows)
        conn.execute(text(f"INSERT INTO ax_task_archive ({columns}, finished_at) "
                          f"VALUES ({values}, 1)"), rows[:2])
    migrate(empty_store)
    with empty_store.connect() as conn:
        hot = dict(conn.execute(text("SELECT task_id, runner FROM ax_task")).all())
        cold = dict(conn.execute(text("SELECT task_id, runner FROM ax_task_archive")).all())
    assert hot == {1: "celery", 2: "celery_ax", 3: "ax", 4: "callback", 5: "ax"}
    assert cold == {1: "celery", 2: "celery_ax"}
    assert "runner" in task_archive.columns
