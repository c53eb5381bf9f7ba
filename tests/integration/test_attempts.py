"""The attempt history and results on real servers: every ended attempt is one row
(worker ends, and the recovery's LOST and UNACKED), results are stored within their bound,
``ax.wait`` returns a finished task, ``ax inspect`` shows the history."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import update

from ax_kombu.config import Settings
from ax_kombu.core.states import Status
from ax_kombu.exceptions import WaitTimeout
from ax_kombu.store import recovery, transitions
from ax_kombu.store.schema import tasks

from .ax_cli import run_ax
from .harness import eventually
from .test_worker import Dispatch, running

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


def _again(dispatch: Dispatch, task_id: int) -> None:
    """A retry's backoff, skipped: the task is due now and dispatched again."""
    with dispatch.client.store.engine.begin() as conn:
        conn.execute(update(tasks).where(tasks.c.task_id == task_id)
                     .values(status="READY", trigger_time=dispatch.client.store.now_ms()))
    dispatch.dispatch([task_id])


def test_each_ended_attempt_is_one_history_row(settings: Settings, dispatch: Dispatch) -> None:
    task_id = dispatch.enqueue("t.flaky", {"k": 1}, max_retry=3)
    with running(settings) as worker:
        dispatch.dispatch([task_id])
        for attempt in (1, 2):
            eventually(lambda a=attempt: len(dispatch.client.get(task_id).attempts) == a)
            _again(dispatch, task_id)
        view = dispatch.client.wait(task_id, timeout=20)
    assert view.status is Status.SUCCESS
    assert [(a.attempt, a.outcome) for a in view.attempts] == [
        (1, "RETRY"), (2, "RETRY"), (3, "SUCCESS")]
    assert [a.error for a in view.attempts] == [
        "RuntimeError: flaky failure #1", "RuntimeError: flaky failure #2", None]
    for a in view.attempts:
        assert a.node == worker.node_id and a.task_type == "t.flaky"
        assert a.dispatched_at is not None and a.started_at is not None
        assert a.dispatched_at <= a.started_at <= a.finished_at
        assert a.duration_ms is not None and 0 <= a.duration_ms <= a.finished_at - a.started_at + 5
    assert view.attempts[-1].finished_at == view.finished_at


def test_a_result_is_stored_within_its_bound_and_the_task_succeeds_either_way(
        settings: Settings, dispatch: Dispatch) -> None:
    settings = settings.replace(max_result_bytes=100)
    small = dispatch.enqueue("t.echo", {"value": {"a": [1, "ü"]}})
    large = dispatch.enqueue("t.echo", {"value": "x" * 200})
    odd = dispatch.enqueue("t.echo", {"value": [1, 2], "set": True})
    nothing = dispatch.enqueue("t.noop", {})
    with running(settings):
        dispatch.dispatch([small, large, odd, nothing])
        views = {t: dispatch.client.wait(t, timeout=20) for t in (small, large, odd, nothing)}
    assert all(v.status is Status.SUCCESS for v in views.values())
    assert views[small].result == {"a": [1, "ü"]} and views[small].attempts[0].error is None
    assert views[large].result is None
    assert "over AX_MAX_RESULT_BYTES (100)" in (views[large].attempts[0].error or "")
    assert views[odd].result is None
    assert "not JSON (TypeError" in (views[odd].attempts[0].error or "")
    assert views[nothing].result is None and views[nothing].attempts[0].error is None


def test_wait_gives_up_after_its_timeout(dispatch: Dispatch) -> None:
    task_id = dispatch.enqueue("t.noop", {}, delay=3600)
    with pytest.raises(WaitTimeout, match="still DELAYED"):
        dispatch.client.wait(task_id, timeout=0.2)


def test_the_recovery_records_lost_and_unacked_attempts(dispatch: Dispatch) -> None:
    lost, unacked = dispatch.enqueue("t.noop", {"i": 1}), dispatch.enqueue("t.noop", {"i": 2})
    dispatch.claim([lost, unacked])
    client = dispatch.client
    now = client.store.now_ms()
    with client.store.engine.begin() as conn:
        assert transitions.start_many(conn, [(lost, 1)], "w-dead", now)
        assert recovery.recover_running(conn, ["w-dead"], now + 5) == [(lost, "DELAYED")]
        assert recovery.redispatch_unacked(conn, now + 10**7, 1000, ["default"], 10) == [
            (unacked, "READY")]
    (gone,), (late,) = client.get(lost).attempts, client.get(unacked).attempts
    assert (gone.outcome, gone.node, gone.error, gone.duration_ms) == ("LOST", "w-dead",
                                                                       "worker lost", 5)
    assert (late.outcome, late.node, late.started_at, late.duration_ms) == (
        "UNACKED", "scheduler@test", None, None)
    assert "not started by a worker within the ack timeout" in (late.error or "")
    with client.store.engine.begin() as conn:  # the worker's late result loses to the record
        transitions.record_attempts(conn, [transitions.Attempt(
            lost, 1, "t.noop", "w-dead", 0, None, None, now + 9, "SUCCESS")])
    assert [a.outcome for a in client.get(lost).attempts] == ["LOST"]


def test_inspect_shows_the_attempts(settings: Settings, dispatch: Dispatch) -> None:
    task_id = dispatch.enqueue("t.echo", {"value": 7})
    with running(settings):
        dispatch.dispatch([task_id])
        dispatch.client.wait(task_id, timeout=20)
    command = ["--db", settings.database_url, "inspect", str(task_id)]
    done = run_ax(*command, "--json")
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    assert shown["result"] == 7
    assert [(a["attempt"], a["outcome"]) for a in shown["attempts"]] == [(1, "SUCCESS")]
    assert shown["attempts"][0]["finished_at"].endswith("+00:00")
    done = run_ax(*command)
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert "attempts: 1" in text and "#1   SUCCESS" in text


def test_a_first_try_success_writes_no_history_row_and_retry_keeps_the_final_attempt(
        settings: Settings, dispatch: Dispatch) -> None:
    """The final attempt is the task row (no extra write on the common path); ``ax retry``
    moves it into the history before the row starts another."""
    from sqlalchemy import func, select

    from ax_kombu.store import admin
    from ax_kombu.store.schema import attempts

    task_id = dispatch.enqueue("t.noop", {"x": 1})
    with running(settings) as worker:
        dispatch.dispatch([task_id])
        first = dispatch.client.wait(task_id, timeout=20)
        with dispatch.client.store.engine.connect() as conn:
            assert conn.execute(select(func.count()).select_from(attempts)).scalar_one() == 0
        assert [(a.attempt, a.outcome, a.node) for a in first.attempts] == [
            (1, "SUCCESS", worker.node_id)]
        with dispatch.client.store.engine.begin() as conn:  # as if it had failed for good
            conn.execute(update(tasks).where(tasks.c.task_id == task_id)
                         .values(status="FAILED", last_error="boom"))
            assert admin.retry_tasks(conn, [task_id]) == [task_id]
        dispatch.dispatch([task_id])
        second = dispatch.client.wait(task_id, timeout=20)
    assert [(a.attempt, a.outcome, a.error) for a in second.attempts] == [
        (1, "FAILED", "boom"), (2, "SUCCESS", None)]
