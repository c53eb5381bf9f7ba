"""receipts.stored_tasks(): what runs is the stored row; a message that differs is named forged."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import Any

import pytest
from kombu import Queue

from ax_kombu.broker.messages import TaskMessage
from ax_kombu.store.transitions import Started
from ax_kombu.worker.lanes import Lane
from ax_kombu.worker.receipts import UnreadablePayload, stored_tasks
from ax_kombu.worker.run import Run
from ax_kombu.worker.task import RunTask


def message(task_id: int, **changes: Any) -> TaskMessage:
    task = TaskMessage(task_id=task_id, attempt=3, task_type="coupon.grant",
                       payload={"user": task_id, "n": [1, 2.5, None]}, trace_id=f"tr{task_id}",
                       trigger_time=1_700_000_000_000, timeout_ms=5000, priority="high",
                       retry_count=1, max_retry=4, processor="coupon.grant", callback_url=None,
                       dispatched_at=1_700_000_000_005, node="scheduler-1")
    return task._replace(**changes)


def same(started: dict[int, RunTask], expected: dict[int, TaskMessage]) -> bool:
    """``started`` holds, field by field, the tasks of ``expected`` (a run's task is a
    RunTask, by name; a message's a TaskMessage). A field no message carries (the job, the
    gate, the shard, the start) must hold RunTask's default: a message names none."""
    fields = dataclasses.fields(RunTask)
    return started.keys() == expected.keys() and all(
        [getattr(started[k], f.name) for f in fields]
        == [getattr(expected[k], f.name, f.default) for f in fields]
        for k in started)


def row(m: TaskMessage, payload: str | None = None) -> Started:
    """The row a genuine message was built from."""
    return Started(m.task_id, m.task_type, m.trigger_time, m.priority, m.retry_count,
                   m.max_retry, m.timeout_ms, m.processor, m.callback_url,
                   json.dumps(m.payload) if payload is None else payload, m.trace_id)


@pytest.fixture
def lane() -> Iterator[Lane]:
    lane = Lane("high", Queue("h"), size=2, multiplier=1, on_release=lambda: None)
    yield lane
    lane.pool.close()


def test_a_genuine_message_is_the_stored_task_and_not_forged(lane: Lane) -> None:
    genuine = [message(1), message(2)]
    deliveries = [Run(lane=lane, task=m, message=None, generation=1) for m in genuine]
    started, forged = stored_tasks(deliveries, [row(genuine[1]), row(genuine[0])])
    assert same(started, {1: genuine[0], 2: genuine[1]}) and forged == []


def test_a_forged_message_gives_way_to_the_row_and_is_named_with_its_fields(lane: Lane) -> None:
    stored = message(7)
    forged_message = stored._replace(payload={"user": 0}, processor=None,
                                     callback_url="http://169.254.169.254/", max_retry=99,
                                     timeout_ms=10**9, dispatched_at=1, node="evil")
    delivery = Run(lane=lane, task=forged_message, message=None, generation=1)
    started, forged = stored_tasks([delivery], [row(stored)])
    # what runs is the row; the message keeps only its attempt, dispatched_at and node
    assert same(started, {7: stored._replace(dispatched_at=1, node="evil")})
    [(who, fields)] = forged
    assert who is delivery
    assert fields == ["payload", "timeout_ms", "max_retry", "processor", "callback_url"]


def test_a_stored_payload_that_is_not_json_is_marked_unreadable(lane: Lane) -> None:
    m = message(9)
    started, _ = stored_tasks([Run(lane=lane, task=m, message=None, generation=1)],
                              [row(m, payload="{not json")])
    assert type(started[9].payload) is UnreadablePayload


def test_a_version_2_message_is_compared_on_the_fields_it_carries(lane: Lane) -> None:
    stored = message(8)
    genuine = TaskMessage.from_body(json.loads(stored.to_json()))
    forged_message = TaskMessage.from_body(json.loads(
        stored._replace(trace_id="evil", trigger_time=1).to_json()))
    started, forged = stored_tasks([Run(lane=lane, task=genuine, message=None, generation=1)],
                                   [row(stored)])
    assert same(started, {8: stored}) and forged == []  # the row fills in all it did not carry
    delivery = Run(lane=lane, task=forged_message, message=None, generation=1)
    started, forged = stored_tasks([delivery], [row(stored)])
    assert same(started, {8: stored})
    assert forged == [(delivery, ["trace_id", "trigger_time"])]
