"""lanes.plan(): which received deliveries start, wait, go back, or are duplicates."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kombu import Queue

from ax_kombu.broker.messages import TaskMessage
from ax_kombu.worker.lanes import Delivery, Lane, plan


def delivery(lane: Lane, task_id: int, attempt: int = 1) -> Delivery:
    task = TaskMessage(task_id=task_id, attempt=attempt, task_type="t", payload=None,
                       trace_id="tr", trigger_time=0, timeout_ms=1000, priority=lane.priority,
                       retry_count=0, max_retry=0, processor=None, callback_url=None,
                       dispatched_at=0, node="s")
    return Delivery(lane, task, message=None, generation=1)


@pytest.fixture
def lanes() -> Iterator[tuple[Lane, Lane]]:
    high = Lane("high", Queue("h"), size=2, multiplier=2, on_release=lambda: None)
    default = Lane("default", Queue("d"), size=1, multiplier=1, on_release=lambda: None)
    yield high, default
    high.pool.close()
    default.pool.close()


def test_starts_up_to_the_free_slots_then_backlogs_then_releases(
        lanes: tuple[Lane, Lane]) -> None:
    high, default = lanes
    fresh = [delivery(high, i) for i in range(6)] + [delivery(default, 10), delivery(default, 11)]
    start, release, dupes = plan([high, default], fresh)
    assert [d.task.task_id for d in start] == [0, 1, 10]
    assert [d.task.task_id for d in high.backlog] == [2, 3]  # pool 2 × (multiplier 2 − 1)
    assert [d.task.task_id for d in release] == [4, 5, 11]
    assert dupes == [] and (high.reserved, default.reserved) == (2, 1)


def test_reserved_slots_are_not_planned_twice(lanes: tuple[Lane, Lane]) -> None:
    high, _ = lanes
    plan([high], [delivery(high, 1), delivery(high, 2)])  # a batch in flight holds both slots
    start, _, _ = plan([high], [delivery(high, 3)])
    assert start == [] and [d.task.task_id for d in high.backlog] == [3]


def test_only_the_newest_attempt_of_a_task_is_kept(lanes: tuple[Lane, Lane]) -> None:
    high, _ = lanes
    old, new, again = delivery(high, 7, 1), delivery(high, 7, 2), delivery(high, 7, 2)
    start, release, dupes = plan([high], [old, new, again])
    assert start == [new] and release == [] and set(map(id, dupes)) == {id(old), id(again)}
