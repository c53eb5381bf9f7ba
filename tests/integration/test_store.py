"""The task store on both backends: enqueue, dedup, get, cancel, and the state machine."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import func, select

from ax_kombu.api import Client
from ax_kombu.core.states import Status
from ax_kombu.exceptions import IllegalTransition, TaskNotFound, ValidationError
from ax_kombu.store import claims, transitions
from ax_kombu.store.engine import db_now_precise_ms, make_engine
from ax_kombu.store.schema import tasks
from ax_kombu.store.tasks import cancelled_on


def count(client: Client) -> int:
    with client.store.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(tasks)).scalar_one())


def test_enqueue_then_get_round_trips_every_field(client: Client) -> None:
    before = client.store.now_ms()
    task_id = client.enqueue("coupon.grant", {"user": 1, "ünï": "ok"}, delay=30,
                             priority="high", max_retry=5, timeout_ms=1500,
                             biz_key="u1-xmas", trace_id="abc123")
    view = client.get(task_id)
    assert task_id.created and view.task_id == task_id
    assert view.status is Status.DELAYED and view.priority == "high"  # written so: due later
    assert view.payload == {"user": 1, "ünï": "ok"}
    assert (view.max_retry, view.timeout_ms, view.biz_key, view.trace_id) == (5, 1500,
                                                                              "u1-xmas", "abc123")
    assert before + 30_000 <= view.trigger_time <= client.store.now_ms() + 30_000
    assert view.attempt == 0 and view.processor_name == "coupon.grant"


def test_run_at_is_stored_to_the_millisecond(client: Client) -> None:
    at = datetime(2031, 5, 1, 20, 0, 0, 123000, tzinfo=UTC)
    assert client.get(client.enqueue("t", {}, run_at=at)).trigger_time == \
        int(at.timestamp() * 1000)


def test_biz_key_makes_enqueue_idempotent(client: Client) -> None:
    first = client.enqueue("order.close", {"v": 1}, biz_key="order-9", delay=60)
    again = client.enqueue("order.close", {"v": 2}, biz_key="order-9", delay=999)
    other_type = client.enqueue("order.remind", {"v": 1}, biz_key="order-9", delay=60)
    assert again == first and again.duplicate
    assert other_type != first and other_type.created
    assert count(client) == 2


def test_fingerprint_dedup_window(client: Client) -> None:
    window = client.settings.dedup_window_ms
    first = client.enqueue("push", {"b": 2, "a": 1}, delay=100)
    t0 = client.get(first).trigger_time
    same = client.enqueue("push", {"a": 1, "b": 2}, run_at=_at(t0 + window - 1))
    apart = client.enqueue("push", {"a": 1, "b": 2}, run_at=_at(t0 + window))
    other_payload = client.enqueue("push", {"a": 1, "b": 3}, run_at=_at(t0))
    assert same == first and same.duplicate
    assert apart.created and other_payload.created
    assert count(client) == 3


def test_cancelled_tasks_do_not_block_a_new_one(client: Client) -> None:
    first = client.enqueue("push", {"a": 1}, delay=100)
    client.cancel(first)
    second = client.enqueue("push", {"a": 1}, delay=100)
    assert second.created and second != first


def test_enqueue_many_dedups_within_the_batch_and_against_the_table(client: Client) -> None:
    existing = client.enqueue("push", {"n": 0}, delay=50)
    items = [{"task_type": "push", "payload": {"n": i % 300}, "delay": 50} for i in range(600)]
    items.append({"task_type": "close", "payload": {}, "biz_key": "k1", "delay": 50})
    items.append({"task_type": "close", "payload": {"x": 1}, "biz_key": "k1", "delay": 50})
    out = client.enqueue_many(items)
    assert out[0] == existing and out[0].duplicate
    assert [o.created for o in out[1:300]] == [True] * 299
    assert all(o.duplicate for o in out[300:600])
    assert out[300 + 7] == out[7]
    assert out[-1] == out[-2] and out[-1].duplicate
    assert count(client) == 1 + 299 + 1
    assert client.get(out[5]).payload == {"n": 5}


def test_a_bad_item_writes_nothing_from_the_batch(client: Client) -> None:
    items = [{"task_type": "ok", "payload": {"i": i}} for i in range(50)]
    items.append({"task_type": "bad", "payload": {}, "priority": "urgent"})
    with pytest.raises(ValidationError, match="item|priority"):
        client.enqueue_many(items)
    with pytest.raises(ValidationError, match="unknown argument"):
        client.enqueue_many([{"task_type": "x", "payload": 1, "dealy": 5}])
    assert count(client) == 0


def test_cancel_only_unfinished_tasks(client: Client) -> None:
    task_id = client.enqueue("t", {}, delay=10)
    assert client.cancel(task_id).status is Status.CANCELLED
    with pytest.raises(IllegalTransition, match="CANCELLED"):
        client.cancel(task_id)
    with pytest.raises(TaskNotFound):
        client.cancel(12345)
    with pytest.raises(TaskNotFound):
        client.get(12345)


def test_a_worker_finds_the_cancelled_tasks_it_fenced_within_its_runs_trigger_times(
        client: Client) -> None:
    """The worker's periodic cancel check: one read by node and trigger-time window, which
    finds a cancel of a run it fenced, and neither another node's nor one outside the
    window nor one not cancelled."""
    ids = [client.enqueue("t", {"i": i}, delay=60 + i) for i in range(5)]
    at = {t: client.get(t).trigger_time for t in ids}
    owners = ["w1", "w1", "w2", "w1", "w1"]
    with client.store.engine.begin() as conn:
        for task_id, owner in zip(ids, owners, strict=True):
            conn.execute(tasks.update().where(tasks.c.task_id == task_id)
                         .values(status="RUNNING", owner_node=owner, attempt=1))
    for task_id in ids[:4]:  # the fifth stays RUNNING
        client.cancel(task_id)
    with client.store.engine.connect() as conn:
        in_window = cancelled_on(conn, "w1", at[ids[0]], at[ids[4]])
        narrow = cancelled_on(conn, "w1", at[ids[1]], at[ids[2]])
        elsewhere = cancelled_on(conn, "w3", at[ids[0]], at[ids[4]])
    assert sorted(in_window) == [ids[0], ids[1], ids[3]]  # w2's and the running one left
    assert narrow == [ids[1]] and elsewhere == []


def test_illegal_transition_is_refused_and_changes_nothing(client: Client) -> None:
    task_id = client.enqueue("t", {}, delay=0)
    assert client.get(task_id).status is Status.READY  # written so: due at once
    with client.store.engine.begin() as conn:
        with pytest.raises(IllegalTransition):
            transitions.transition(conn, [task_id], [Status.READY], Status.SUCCESS)
        # a legal move from the wrong current state loses the compare-and-set
        assert transitions.transition(conn, [task_id], [Status.RUNNING], Status.SUCCESS) == []
    assert client.get(task_id).status is Status.READY


def test_claim_fences_with_the_attempt(client: Client) -> None:
    task_id = client.enqueue("t", {}, delay=0)
    now = client.store.now_ms() + 10
    with client.store.engine.begin() as conn:
        (row,) = claims.claim(conn, [task_id], "node-a", now)
        assert row.attempt == 1 and row.task_id == task_id
        assert claims.claim(conn, [task_id], "node-b", now) == []  # already DISPATCHING
        # ack timeout: back to READY, claimed again with a new attempt
        transitions.transition(conn, [task_id], [Status.DISPATCHING], Status.READY)
        (row,) = claims.claim(conn, [task_id], "node-b", now)
        assert row.attempt == 2
        # the stale message of attempt 1 cannot start the task; attempt 2 can
        assert transitions.transition(conn, [task_id], [Status.DISPATCHING], Status.RUNNING,
                                 attempt=1) == []
        assert transitions.transition(conn, [task_id], [Status.DISPATCHING], Status.RUNNING,
                                 attempt=2) == [task_id]
    view = client.get(task_id)
    assert (view.status, view.owner_node, view.attempt) == (Status.RUNNING, "node-b", 2)


def test_claim_leaves_tasks_that_are_not_due(client: Client) -> None:
    task_id = client.enqueue("t", {}, delay=60)
    with client.store.engine.begin() as conn:
        assert claims.claim(conn, [task_id], "n", client.store.now_ms()) == []
    assert client.get(task_id).status is Status.DELAYED


def _at(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, UTC) + timedelta(0)


def test_bulk_path_keeps_awkward_payloads_intact(client: Client) -> None:
    awkward = ['quote " and \\\\ backslash', "comma, new\nline\ttab", "emoji 🎄 and 中文",
               "", "\\N", '","', "NULL"]
    items = [{"task_type": "awkward", "payload": {"s": s, "i": i}, "delay": 60,
              "biz_key": f'k,"{i}"'} for i, s in enumerate(awkward * 5)]
    ids = client.enqueue_many(items)
    assert all(i.created for i in ids)
    for task_id, item in zip(ids, items, strict=True):
        view = client.get(task_id)
        assert view.payload == item["payload"]
        assert view.biz_key == item["biz_key"]


@pytest.mark.integration
def test_postgresql_indexes_only_tasks_with_a_biz_key_and_still_enforces_it(pg_url: str) -> None:
    from sqlalchemy import insert, text
    from sqlalchemy.exc import IntegrityError

    from ax_kombu.store.engine import make_engine, migrate

    engine = make_engine(pg_url)
    try:
        migrate(engine)
        with engine.connect() as conn:
            definition = conn.execute(text(
                "SELECT indexdef FROM pg_indexes WHERE indexname = 'uq_ax_task_type_biz_key'"
            )).scalar_one()
            assert "UNIQUE" in definition and "WHERE (biz_key IS NOT NULL)" in definition
        row = {"task_type": "t", "trigger_time": 1, "status": "CREATED", "priority": "default",
               "max_retry": 0, "timeout_ms": 1000, "processor_name": "p", "payload": "{}",
               "fingerprint": "f", "trace_id": "x", "created_at": 1}
        with engine.begin() as conn:  # tasks without a biz_key never conflict
            conn.execute(insert(tasks), [{**row, "task_id": i} for i in (1, 2)])
            conn.execute(insert(tasks), {**row, "task_id": 3, "biz_key": "k"})
        with pytest.raises(IntegrityError), engine.begin() as conn:
            conn.execute(insert(tasks), {**row, "task_id": 4, "biz_key": "k"})
        with engine.connect() as conn:
            assert conn.execute(text("SELECT COUNT(*) FROM ax_task")).scalar_one() == 3
    finally:
        engine.dispose()


@pytest.mark.integration
def test_the_clock_reading_is_exact_to_well_under_a_millisecond(pg_url: str) -> None:
    """The offset is measured from a reading to the microsecond: one rounded to whole
    milliseconds made staged tasks start up to half a millisecond before their trigger time.
    PostgreSQL runs on this host here, so its clock is the wall clock."""
    engine = make_engine(pg_url)
    try:
        with engine.connect() as conn:
            readings = []
            for _ in range(20):
                before = time.time() * 1000
                db = db_now_precise_ms(conn)
                after = time.time() * 1000
                readings.append((before, db, after))
    finally:
        engine.dispose()
    assert all(before - 0.05 <= db <= after + 0.05 for before, db, after in readings), readings
    assert any(db != int(db) for _, db, _ in readings), "every reading was a whole millisecond"
