"""What a run's outcome turns into: SUCCESS, FAILED, or DELAYED with backoff."""

from __future__ import annotations

import random
import threading
import time

from ax_kombu.config import from_env
from ax_kombu.core.states import Status
from ax_kombu.exceptions import ProcessorRefused
from ax_kombu.worker.counters import Room
from ax_kombu.worker.outcomes import RunResult, decide
from ax_kombu.worker.pools import Outcome
from ax_kombu.worker.task import RunTask

SETTINGS = from_env({}, retry_backoff_base_ms=1000, retry_backoff_max_ms=60_000,
                    retry_backoff_jitter=0.5)


def task(retry_count: int = 0, max_retry: int = 3) -> RunTask:
    return RunTask(task_id=7, attempt=2, task_type="t", payload={}, trace_id="tr",
                   trigger_time=0, timeout_ms=300, priority="default",
                   retry_count=retry_count, max_retry=max_retry, processor="t",
                   callback_url=None, dispatched_at=0, node="n")


def test_success() -> None:
    finish = decide(RunResult(task(), Outcome(True), 5000), SETTINGS, random.Random(1))
    assert (finish.status, finish.at_ms, finish.error, finish.attempt) == (
        Status.SUCCESS, 5000, None, 2)


def test_a_failure_with_retries_left_is_delayed_by_the_backoff() -> None:
    for retry in range(3):
        outcome = Outcome(False, error=ValueError("bad input"))
        finish = decide(RunResult(task(retry), outcome, 10_000), SETTINGS, random.Random(retry))
        ceiling = 1000 * 2 ** retry
        assert finish.status is Status.DELAYED
        assert 10_000 + ceiling // 2 <= finish.at_ms <= 10_000 + ceiling
        assert finish.error == "ValueError: bad input"


def test_no_retries_left_is_final() -> None:
    outcome = Outcome(False, error=ValueError("bad"))
    finish = decide(RunResult(task(3, 3), outcome, 10_000), SETTINGS, random.Random(1))
    assert (finish.status, finish.at_ms) == (Status.FAILED, 10_000)


def test_a_refused_processor_is_final_even_with_retries_left() -> None:
    outcome = Outcome(False, error=ProcessorRefused("processor 'os:system' refused"))
    finish = decide(RunResult(task(0, 5), outcome, 10_000), SETTINGS, random.Random(1))
    assert finish.status is Status.FAILED
    assert finish.error is not None and "refused" in finish.error


def test_timeouts_and_abandoned_runs_are_failures_that_may_retry() -> None:
    timed_out = decide(RunResult(task(), Outcome(False, timed_out=True), 0), SETTINGS,
                       random.Random(1))
    assert timed_out.status is Status.DELAYED
    assert timed_out.error == "timed out after 300 ms"
    abandoned = decide(RunResult(task(3, 3), Outcome(False, abandoned="worker shut down"), 0),
                       SETTINGS, random.Random(1))
    assert (abandoned.status, abandoned.error) == (Status.FAILED, "abandoned: worker shut down")


def test_a_huge_error_is_truncated() -> None:
    outcome = Outcome(False, error=RuntimeError("x" * 10_000))
    finish = decide(RunResult(task(3, 3), outcome, 0), SETTINGS, random.Random(1))
    assert finish.error is not None and len(finish.error) == 2000


def test_the_room_bounds_outcomes_and_wakes_a_waiter_when_a_batch_frees_places() -> None:
    room = Room(2)
    assert room.take(0.0) and room.take(0.0)
    assert not room.take(0.0) and not room.take(0.01)  # full: no place comes
    got: list[bool] = []
    waiter = threading.Thread(target=lambda: got.append(room.take(10.0)))
    waiter.start()
    deadline = time.monotonic() + 5
    while not room._waiting and time.monotonic() < deadline:
        time.sleep(0.001)  # until it waits
    room.give(3)
    waiter.join(5)
    assert got == [True]
    assert room.take(0.0) and room.take(0.0) and not room.take(0.0)  # 3 freed, 1 taken
