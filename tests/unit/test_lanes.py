"""planning.plan(): which received deliveries start, wait, go back, or are duplicates."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kombu import Queue

from ax_kombu.broker.messages import TaskMessage
from ax_kombu.worker.lanes import STAGE_PER_THREAD, Lane
from ax_kombu.worker.planning import plan
from ax_kombu.worker.run import Run


def delivery(lane: Lane, task_id: int, attempt: int = 1) -> Run[Lane]:
    task = TaskMessage(task_id=task_id, attempt=attempt, task_type="t", payload=None,
                       trace_id="tr", trigger_time=0, timeout_ms=1000, priority=lane.priority,
                       retry_count=0, max_retry=0, processor=None, callback_url=None,
                       dispatched_at=0, node="s")
    return Run(lane=lane, task=task, message=None, generation=1)


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


def test_the_stage_is_what_the_threads_finish_within_the_horizon_bounded_per_thread() -> None:
    lane = Lane("default", Queue("d"), size=4, multiplier=1, on_release=lambda: None,
                stage_horizon_s=1.0)
    try:
        for _ in range(200):
            lane.timed(0.049)  # 50 ms a run with the overhead: 4 threads finish 80 in 1 s
        assert 75 <= lane.stage_target() <= 85
        assert lane.target() == lane.window == 4 + lane.pool.stage_max
        for _ in range(400):
            lane.timed(0.0)  # 1 ms a run: 4,000 in 1 s, but at most 200 per thread
        assert lane.stage_target() == 4 * STAGE_PER_THREAD
        for _ in range(400):
            lane.timed(10.0)  # slower than the horizon: the stage is never below the threads
        assert lane.stage_target() == 4
    finally:
        lane.pool.close()


def test_the_first_run_timed_sets_the_stage_at_once() -> None:
    """Not an average decaying from the 1 s guess: a burst soon after start finds a full
    stage (issue 21)."""
    lane = Lane("default", Queue("d"), size=4, multiplier=1, on_release=lambda: None,
                stage_horizon_s=1.0)
    try:
        assert lane.stage_target() == 4  # nothing timed: one run per thread
        lane.timed(0.0)
        assert lane.stage_target() == 4 * STAGE_PER_THREAD
        lane.timed(1.0)  # later runs move the average by RUN_EWMA
        assert 4 * 15 <= lane.stage_target() <= 4 * 25
    finally:
        lane.pool.close()


def test_a_lane_plans_runs_into_its_stage_beyond_its_threads() -> None:
    lane = Lane("default", Queue("d"), size=2, multiplier=1, on_release=lambda: None,
                stage_horizon_s=1.0)
    try:
        stage = lane.pool.stage_max
        fresh = [delivery(lane, i) for i in range(2 + 2 * stage + 1)]
        start, release, _ = plan([lane], fresh)
        assert start == fresh[:2 + stage] and lane.reserved == 2 + stage
        # received beyond the room (the stage shrank while they came) waits, up to the stage
        assert list(lane.backlog) == fresh[2 + stage:2 + 2 * stage]
        assert release == fresh[2 + 2 * stage:]
    finally:
        lane.pool.close()


class RecordingConsumer:
    """What a lane asks of its Kombu consumer, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, ...]] = []

    def qos(self, prefetch_count: int, apply_global: bool) -> None:
        self.calls.append(("qos", str(prefetch_count), "global" if apply_global else "own"))

    def consume(self) -> None:
        self.calls.append(("consume",))

    def cancel(self) -> None:
        self.calls.append(("cancel",))


def test_a_quorum_lane_changes_its_prefetch_by_consuming_anew_at_most_once_an_interval(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A quorum queue takes no per-channel prefetch, and a consumer's own is fixed when it
    starts: the lane cancels, sets it and consumes again, at most once per interval."""
    import ax_kombu.worker.lanes as lanes_module

    clock = [100.0]
    monkeypatch.setattr(lanes_module.time, "monotonic", lambda: clock[0])
    lane = Lane("default", Queue("d"), size=4, multiplier=1, on_release=lambda: None)
    try:
        consumer = RecordingConsumer()
        lane.attach(consumer, True, reconsume=True)
        assert consumer.calls == [("qos", "4", "own"), ("consume",)]
        lane.acked_running = 1  # a long run acked at start: one slot fewer
        lane.apply(True)
        assert consumer.calls[2:] == [("cancel",), ("qos", "3", "own"), ("consume",)]
        lane.acked_running = 2
        lane.apply(True)  # within the interval: the prefetch stays
        assert len(consumer.calls) == 5 and lane.prefetch == 3
        clock[0] += lanes_module.RECONSUME_INTERVAL_S
        lane.apply(True)
        assert consumer.calls[5:] == [("cancel",), ("qos", "2", "own"), ("consume",)]
        classic = RecordingConsumer()  # a classic queue: the channel's prefetch, at once
        lane.attach(classic, True)
        lane.acked_running = 1
        lane.apply(True)
        assert classic.calls == [("qos", "2", "global"), ("consume",), ("qos", "3", "global")]
    finally:
        lane.pool.close()
