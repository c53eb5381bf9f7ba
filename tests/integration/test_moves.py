"""Moving and cancelling pending tasks by id or business key, unique-while-pending keys and
replacing enqueues (:mod:`ax_kombu.store.moves`, :mod:`ax_kombu.store.keys`), on SQLite and
PostgreSQL; and unique-while-pending under 8 producer processes on PostgreSQL.

Races with a real scheduler and worker are in tests/e2e/test_moves_e2e.py."""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import text

from ax_kombu.api import Client
from ax_kombu.config import from_env
from ax_kombu.core.states import Status
from ax_kombu.exceptions import IllegalTransition, TaskNotFound, TooLateToMove, ValidationError

from ..procs import context as procs_context

pytestmark = [pytest.mark.timeout(120)]


def _set(client: Client, task_id: int, status: str, **columns: Any) -> None:
    """Put a task in ``status`` as a scheduler or worker would have (test set-up)."""
    sets = ", ".join(["status = :status", *(f"{c} = :{c}" for c in columns)])
    with client.store.engine.begin() as conn:
        conn.execute(text(f"UPDATE ax_task SET {sets} WHERE task_id = :t"),
                     {"status": status, "t": task_id, **columns})


def _row(client: Client, task_id: int) -> Any:
    with client.store.engine.connect() as conn:
        return conn.execute(text("SELECT * FROM ax_task WHERE task_id = :t"),
                            {"t": task_id}).one()


def test_reschedule_by_id_and_by_key_moves_the_time_and_records_it(client: Client) -> None:
    task = client.enqueue("order.close", {"order": 42}, delay=60, biz_key="42")
    before = client.get(task)
    moved = client.reschedule(task, delay=3600)
    assert moved.trigger_time - before.trigger_time == pytest.approx(3_540_000, abs=2_000)
    assert moved.status is Status.DELAYED
    at = datetime.now(UTC) + timedelta(hours=2)
    by_key = client.reschedule(task_type="order.close", biz_key="42", run_at=at)
    assert by_key.task_id == task and by_key.trigger_time == round(at.timestamp() * 1000)
    assert [(m.kind, m.from_time, m.to_time) for m in by_key.moves] == [
        ("reschedule", before.trigger_time, moved.trigger_time),
        ("reschedule", moved.trigger_time, by_key.trigger_time)]
    now = client.run_now(task_type="order.close", biz_key="42")
    assert now.status is Status.READY and now.moves[-1].kind == "run_now"
    assert abs(now.trigger_time - client.store.now_ms()) < 2_000
    with client.store.engine.connect() as conn:  # the new time is where a preload reads it
        due = conn.execute(text("SELECT trigger_time FROM ax_due WHERE task_id = :t"),
                           {"t": task}).scalars().all()
    assert now.trigger_time in due


def test_a_new_payload_is_stored_and_checked_for_duplicates(client: Client) -> None:
    task = client.enqueue("push", {"v": 1}, delay=100)
    moved = client.reschedule(task, delay=100, payload={"v": 2})
    assert moved.payload == {"v": 2}
    assert client.enqueue("push", {"v": 2}, delay=100) == task  # the new payload duplicates
    assert client.enqueue("push", {"v": 1}, delay=100).created  # the old one no longer


@pytest.mark.parametrize("status", ["DISPATCHING", "RUNNING"])
def test_a_claimed_or_staged_task_is_too_late_to_move(client: Client, status: str) -> None:
    task = client.enqueue("t", {}, delay=30)
    _set(client, task, status, attempt=1)
    row = _row(client, task)
    with pytest.raises(TooLateToMove, match="staged for its start.*too close"):
        client.reschedule(task, delay=600)
    _set(client, task, status, trigger_time=row.trigger_time - 60_000)
    with pytest.raises(TooLateToMove, match="already started"):
        client.run_now(task)
    after = _row(client, task)
    assert (after.status, after.trigger_time, after.attempt) == (status, row.trigger_time - 60_000, 1)
    assert client.get(task).moves == ()


def test_bad_calls_change_nothing(client: Client) -> None:
    task = client.enqueue("t", {"a": 1}, delay=30, biz_key="k")
    done = client.enqueue("t", {"a": 2}, delay=30)
    _set(client, done, "SUCCESS")
    snapshot = (_row(client, task), _row(client, done))
    with pytest.raises(ValidationError, match="not both"):
        client.reschedule(task, task_type="t", biz_key="k", delay=5)
    with pytest.raises(ValidationError, match="not both"):
        client.cancel(task, biz_key="k")
    with pytest.raises(ValidationError, match="both task_type and biz_key"):
        client.cancel(biz_key="k")
    with pytest.raises(ValidationError, match="run_at or delay"):
        client.reschedule(task)
    with pytest.raises(ValidationError, match="naive"):
        client.reschedule(task, run_at=datetime(2030, 1, 1))
    with pytest.raises(IllegalTransition, match="SUCCESS"):
        client.reschedule(done, delay=5)
    with pytest.raises(IllegalTransition, match="SUCCESS"):
        client.cancel(done)
    with pytest.raises(TaskNotFound):
        client.reschedule(task_type="t", biz_key="nope", delay=5)
    with pytest.raises(TaskNotFound):
        client.cancel(task_type="t", biz_key="nope")
    assert (_row(client, task), _row(client, done)) == snapshot


def test_cancel_by_key_and_in_bulk(client: Client) -> None:
    order = client.enqueue("order.close", {"o": 1}, delay=60, biz_key="o-1")
    assert client.cancel(task_type="order.close", biz_key="o-1").status is Status.CANCELLED
    sms = [client.enqueue("sms.send", {"i": i}, delay=60, biz_key=f"s{i}") for i in range(10)]
    _set(client, sms[0], "RUNNING", attempt=1)
    _set(client, sms[1], "FAILED")
    other = client.enqueue("push", {"i": 0}, delay=60)
    assert client.cancel_many(task_type="sms.send", status="RUNNING") == 1
    assert client.cancel_many(task_type="sms.send", biz_keys=["s2", "s3", "s1"]) == 2
    assert client.cancel_many(task_type="sms.send", since=timedelta(minutes=5)) == 6
    assert client.cancel_many(task_type="sms.send", batch=2) == 0  # nothing left to cancel
    statuses = [client.get(t).status for t in sms]
    assert statuses.count(Status.CANCELLED) == 9 and statuses[1] is Status.FAILED
    assert client.get(other).status is Status.DELAYED and client.get(order).status is Status.CANCELLED
    for bad, message in (({}, "task_type or biz_keys"),
                         ({"task_type": "x", "status": "SUCCESS"}, "cannot be cancelled"),
                         ({"task_type": "x", "status": "LATE"}, "unknown status"),
                         ({"biz_keys": "s1"}, "a list of keys")):
        with pytest.raises(ValidationError, match=message):
            client.cancel_many(**bad)


def test_unique_while_pending_gives_a_finished_holder_s_key_to_a_new_task(
        client: Client) -> None:
    first = client.enqueue("remind", {"u": 7}, biz_key="user-7", unique="pending")
    again = client.enqueue("remind", {"u": 7, "n": 2}, biz_key="user-7", unique="pending")
    assert again == first and again.duplicate
    _set(client, first, "SUCCESS")
    second = client.enqueue("remind", {"u": 7, "n": 2}, biz_key="user-7", unique="pending")
    assert second.created and second != first
    old = client.get(first)
    assert (old.biz_key, old.released_key) == (None, "user-7")
    assert client.get(second).biz_key == "user-7"
    # the default stays unique for good
    _set(client, second, "FAILED")
    assert client.enqueue("remind", {"u": 7, "n": 3}, biz_key="user-7") == second


def test_replace_debounces_a_pending_task_and_not_a_started_one(client: Client) -> None:
    first = client.enqueue("digest", {"changes": 1}, delay=600, biz_key="u1")
    replaced = client.enqueue("digest", {"changes": 2}, delay=900, biz_key="u1",
                              on_conflict="replace")
    assert replaced == first and replaced.replaced and not replaced.duplicate
    view = client.get(first)
    assert view.payload == {"changes": 2} and view.moves[-1].kind == "replace"
    assert view.trigger_time - view.created_at == pytest.approx(900_000, abs=2_000)
    _set(client, first, "RUNNING", attempt=1)
    kept = client.enqueue("digest", {"changes": 3}, delay=900, biz_key="u1",
                          on_conflict="replace")
    assert kept == first and kept.duplicate and client.get(first).payload == {"changes": 2}
    # in one batch, the later item replaces the earlier one
    batch = client.enqueue_many([
        {"task_type": "digest", "payload": {"c": 1}, "biz_key": "u2"},
        {"task_type": "digest", "payload": {"c": 2}, "biz_key": "u2", "on_conflict": "replace",
         "delay": 30}])
    assert batch[0].created and batch[1] == batch[0] and batch[1].replaced
    assert client.get(batch[0]).payload == {"c": 2}
    with pytest.raises(ValidationError, match="apply to a biz_key"):
        client.enqueue("digest", {}, on_conflict="replace")
    with pytest.raises(ValidationError, match="unique must be"):
        client.enqueue("digest", {}, biz_key="x", unique="sometimes")


def _produce(url: str, rounds: int, out: Any) -> None:
    """One producer process: enqueue the same key ``rounds`` times, unique while pending."""
    client = Client(from_env({}, database_url=url))
    created = 0
    try:
        for i in range(rounds):
            got = client.enqueue("remind", {"pid": os.getpid(), "i": i}, biz_key="user-7",
                                 unique="pending")
            created += got.created
    finally:
        client.close()
    out.put(created)


@pytest.mark.integration
def test_unique_while_pending_holds_under_eight_producer_processes(pg_url: str) -> None:
    """8 processes enqueue one key while this one keeps finishing whatever holds it: never
    two unfinished tasks of the key at once, and every task made was counted by its maker."""
    client = Client(from_env({}, database_url=pg_url))
    ctx = procs_context()
    out = ctx.Queue()
    procs = [ctx.Process(target=_produce, args=(pg_url, 40, out)) for _ in range(8)]
    try:
        for p in procs:
            p.start()
        finished = 0
        while any(p.is_alive() for p in procs) or finished == 0:
            with client.store.engine.begin() as conn:
                finished += conn.execute(text(
                    "UPDATE ax_task SET status = 'SUCCESS' WHERE task_type = 'remind' "
                    "AND status IN ('DELAYED', 'READY')")).rowcount
                pending = conn.execute(text(
                    "SELECT count(*) FROM ax_task WHERE task_type = 'remind' AND status NOT IN "
                    "('SUCCESS', 'FAILED', 'CANCELLED')")).scalar_one()
            assert pending <= 1
        for p in procs:
            p.join(60)
            assert p.exitcode == 0
        created = sum(out.get(timeout=10) for _ in procs)
        with client.store.engine.connect() as conn:
            rows = conn.execute(text("SELECT biz_key, released_key, status FROM ax_task "
                                     "WHERE task_type = 'remind'")).all()
    finally:
        client.close()
    assert created == len(rows) and created > 1
    assert sum(r.biz_key == "user-7" for r in rows) == 1
    assert all(r.released_key == "user-7" and r.status == "SUCCESS"
               for r in rows if r.biz_key is None)
