"""The listing's scan (:class:`ax_kombu.worker.listing.ListingScan`): the waiting runs a
lane's threads will not reach within LIST_AFTER_S become LISTED (and the listing is told),
those the threads take first kept off the list; once the lane will reach them, they are
released early. Pure memory: the listing's writer is a stand-in."""

from __future__ import annotations

import random
import time
from collections.abc import Iterable, Iterator, Sequence

import pytest
from kombu import Queue

from ax_kombu.broker.messages import TaskMessage
from ax_kombu.worker.lanes import Lane
from ax_kombu.worker.listing import ListingScan
from ax_kombu.worker.run import Run, State
from ax_kombu.worker.stage import Stage

pytestmark = pytest.mark.timeout(30)


class Told:
    """Stands in for the Listing: records what it is told."""

    def __init__(self) -> None:
        self.added: list[tuple[int, int]] = []
        self.soon: list[int] = []

    def add(self, runs: Iterable[tuple[int, int]]) -> None:
        self.added += list(runs)

    def release_soon(self, ids: Sequence[int]) -> None:
        self.soon += list(ids)

    @property
    def any(self) -> bool:
        return bool(self.added)


@pytest.fixture
def lane() -> Iterator[Lane]:
    lane = Lane("default", Queue("d"), size=1, multiplier=1, on_release=lambda: None,
                stage_horizon_s=60.0)
    yield lane
    lane.pool.close()


def staged(lane: Lane, stage: Stage, triggers: list[int]) -> list[Run[Lane]]:
    """Runs fenced and waiting in ``lane``'s pool (their jobs wait far ahead), submitted in
    the order given (their :attr:`Run.order`, as the starter numbers them)."""
    runs = []
    for task_id, trigger in enumerate(triggers, 1):
        task = TaskMessage(task_id=task_id, attempt=1, task_type="t", payload={},
                           trace_id="tr", trigger_time=trigger, timeout_ms=1000,
                           priority="default", retry_count=0, max_retry=0, processor="p",
                           callback_url=None, dispatched_at=0, node="s")
        runs.append(Run(lane=lane, task=task, message=None, generation=1,
                        state=State.FENCED, incarnation=7, order=(float(trigger), task_id)))
        assert lane.pool.try_submit(lambda: None, lambda outcome: None,
                                    start_at=time.monotonic() + 600)
    stage.add(runs)
    return runs


def test_runs_beyond_the_lanes_reach_are_listed_and_released_once_in_reach(lane: Lane) -> None:
    stage, told = Stage(), Told()
    scan = ListingScan(stage, [lane], told)  # type: ignore[arg-type]
    lane.timed(10.0)  # a run takes 10 s: the lane's one thread reaches none within 1 s
    runs = staged(lane, stage, [300, 100, 200])
    scan()
    assert all(r.state is State.LISTED for r in runs)
    assert sorted(told.added) == [(1, 7), (2, 7), (3, 7)] and told.soon == []
    scan()  # nothing new to list
    assert len(told.added) == 3
    lane.run_s = 0.001  # now the lane reaches them all within 1 s: released early
    scan()
    assert sorted(told.soon) == [1, 2, 3]
    assert all(r.state is State.LISTED for r in runs)  # a thread releases each as it takes it


def test_a_lane_whose_run_time_is_unmeasured_lists_nothing(lane: Lane) -> None:
    stage, told = Stage(), Told()
    runs = staged(lane, stage, [100, 200])
    ListingScan(stage, [lane], told)()  # type: ignore[arg-type]
    assert all(r.state is State.STAGED for r in runs) and told.added == []


def test_a_bursts_runs_are_listed_in_the_order_the_threads_take_them(lane: Lane) -> None:
    """Runs of one trigger time (a burst): the runs the threads take first stay off the list
    and the later ones are listed, whatever order the stage (a set) yields them in; as the
    lane's reach grows, the next ones in take order are released. (Sorted by trigger time
    alone, a burst's runs were listed at random, and the threads kept reaching listed runs
    and waiting for a write each.)"""
    stage, told = Stage(), Told()
    scan = ListingScan(stage, [lane], told)  # type: ignore[arg-type]
    runs = staged(lane, stage, [100] * 40)
    takes = list(range(1, 41))
    random.Random(7).shuffle(takes)
    for run, taken in zip(runs, takes, strict=True):
        run.order = (0.0, taken)  # due at once: taken by submission number
    first = sorted(runs, key=lambda r: r.order)
    lane.timed(0.3)  # one thread, 0.3 s a run (and 1 ms besides): it reaches 3 within 1 s
    scan()
    assert [r.state for r in first] == [State.STAGED] * 3 + [State.LISTED] * 37
    assert told.soon == []
    lane.run_s = 0.12  # now 8 are within reach: the next 5 in take order are released early
    scan()
    assert told.soon == [r.task.task_id for r in first[3:8]]
