"""Deferred runs: a pool's slots bound ``async def`` runs on the event loop, with fewer
threads than slots; timeouts, cancellation and abandon cancel the coroutine; one outcome each."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import pytest

from ax_kombu.core.context import Cancellation
from ax_kombu.worker.eventloop import EventLoop, EventLoopStopped
from ax_kombu.worker.executor import Deferred, Ended
from ax_kombu.worker.pools import Outcome, Pool, Submission
from tests.waiting import eventually

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def loop() -> Iterator[EventLoop]:
    event_loop = EventLoop("test-loop")
    yield event_loop
    event_loop.stop()


class Bodies:
    """Coroutines that count how many run at once and wait for a release."""

    def __init__(self) -> None:
        self.now = 0
        self.most = 0
        self.started = 0
        self.cancelled = 0
        self.gate: asyncio.Event | None = None

    async def body(self, seconds: float = 10.0, result: Any = "ok") -> Any:
        self.now += 1  # the loop's thread only: no lock needed
        self.started += 1
        self.most = max(self.most, self.now)
        try:
            await asyncio.sleep(seconds)
            return result
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.now -= 1


def deferred(loop: EventLoop, body: Callable[[], Any],
             cancel: Cancellation | None = None) -> Callable[[], Deferred]:
    """A job function returning a Deferred that runs ``body`` on ``loop``."""
    def fn() -> Deferred:
        def launch(ended: Ended) -> None:
            loop.run(body, ended, cancel)
        return Deferred(launch)
    return fn


def collect() -> tuple[list[Outcome], Callable[[Outcome], None]]:
    seen: list[Outcome] = []
    lock = threading.Lock()

    def done(outcome: Outcome) -> None:
        with lock:
            seen.append(outcome)
    return seen, done


def test_slots_bound_deferred_runs_beyond_the_pools_threads(loop: EventLoop) -> None:
    pool, bodies = Pool("a", 5, threads=2), Bodies()
    pool.stage_max = 20
    assert sum(t.is_alive() for t in pool._threads) == 2
    seen, done = collect()
    for i in range(20):
        assert pool.try_submit(deferred(loop, partial(bodies.body, 0.05, i)), done)
    eventually(lambda: len(seen) == 20, 10, "all 20 deferred runs reported")
    assert bodies.most == 5 and bodies.started == 20
    assert sorted(o.value for o in seen) == list(range(20)) and all(o.ok for o in seen)
    assert all(o.duration_s >= 0.05 for o in seen)  # the coroutine's time, not the launch's
    eventually(lambda: pool.free == 5 and not pool.active)


def test_a_timed_out_deferred_run_is_cancelled_and_reported_timed_out_once(
        loop: EventLoop) -> None:
    pool, bodies, cancel = Pool("t", 2, threads=1), Bodies(), Cancellation()
    seen, done = collect()
    pool.try_submit(deferred(loop, bodies.body, cancel), done, timeout_s=0.1, cancel=cancel)
    eventually(lambda: len(seen) == 1, 5, "the timed-out run reported")
    (outcome,) = seen
    assert outcome.timed_out and not outcome.ok and cancel.reason == "timeout"
    assert bodies.cancelled == 1 and outcome.duration_s < 5
    assert pool.timeouts == 1
    eventually(lambda: pool.overdue == 0 and pool.free == 2 and pool.stuck == 0)


def test_a_cancelled_deferred_run_ends_with_the_reason_never_as_a_success(
        loop: EventLoop) -> None:
    pool, bodies, cancel = Pool("c", 2), Bodies(), Cancellation()
    seen, done = collect()
    pool.try_submit(deferred(loop, bodies.body, cancel), done, cancel=cancel)
    eventually(lambda: bodies.started == 1)
    cancel.set("cancelled")
    eventually(lambda: len(seen) == 1, 5)
    assert not seen[0].ok and isinstance(seen[0].error, asyncio.CancelledError)
    assert "cancelled: cancelled" in str(seen[0].error)


def test_a_body_that_swallows_its_cancellation_still_times_out(loop: EventLoop) -> None:
    async def stubborn() -> str:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            return "swallowed"
        return "slept"

    pool, cancel = Pool("s", 1), Cancellation()
    seen, done = collect()
    pool.try_submit(deferred(loop, stubborn, cancel), done, timeout_s=0.05, cancel=cancel)
    eventually(lambda: len(seen) == 1, 5)
    assert seen[0].timed_out and not seen[0].ok


def test_abandon_reports_deferred_runs_and_their_slots_free_when_they_end(
        loop: EventLoop) -> None:
    released = threading.Event()
    pool, bodies = Pool("x", 3, threads=1, on_release=released.set), Bodies()
    seen, done = collect()
    cancels = [Cancellation() for _ in range(3)]
    for cancel in cancels:
        pool.try_submit(deferred(loop, bodies.body, cancel), done, cancel=cancel)
    eventually(lambda: bodies.started == 3)
    assert pool.abandon("stopping") == 3
    assert [o.abandoned for o in seen] == ["stopping"] * 3 and not pool.active
    assert all(c.reason == "shutdown" for c in cancels)
    eventually(released.is_set, 5, "a cancelled abandoned run released its slot")
    eventually(lambda: pool.stuck == 0 and pool.free == 3 and bodies.cancelled == 3)
    assert len(seen) == 3  # one outcome each: the late ends report nothing


def test_a_body_error_is_the_outcome_and_a_sync_job_still_runs_on_the_thread(
        loop: EventLoop) -> None:
    async def fails() -> None:
        raise ValueError("boom")

    pool = Pool("e", 2, threads=1)
    seen, done = collect()
    pool.try_submit(deferred(loop, fails), done)
    pool.try_submit(lambda: 42, done)
    eventually(lambda: len(seen) == 2, 5)
    assert {o.value for o in seen if o.ok} == {42}
    (failed,) = [o for o in seen if not o.ok]
    assert isinstance(failed.error, ValueError)


def test_a_run_handed_to_a_stopped_loop_ends_at_once_without_its_body(
        loop: EventLoop) -> None:
    bodies = Bodies()
    loop.stop()
    ended: list[tuple[Any, BaseException | None]] = []
    loop.run(bodies.body, lambda value, error: ended.append((value, error)))
    assert bodies.started == 0 and isinstance(ended[0][1], EventLoopStopped)


def test_stopping_the_loop_cancels_what_runs_and_reports_each_end(loop: EventLoop) -> None:
    bodies = Bodies()
    ended: list[BaseException | None] = []
    for _ in range(3):
        loop.run(bodies.body, lambda value, error: ended.append(error))
    eventually(lambda: bodies.started == 3)
    loop.stop()
    assert len(ended) == 3 and all(isinstance(e, asyncio.CancelledError) for e in ended)


def test_a_cancellation_set_before_the_run_starts_cancels_it_at_once(
        loop: EventLoop) -> None:
    cancel = Cancellation()
    cancel.set("cancelled")
    bodies = Bodies()
    ended: list[BaseException | None] = []
    loop.run(partial(bodies.body, 10), lambda value, error: ended.append(error), cancel)
    eventually(lambda: len(ended) == 1, 5)
    assert isinstance(ended[0], asyncio.CancelledError)


def test_wait_async_returns_when_the_signal_is_set_from_another_thread() -> None:
    cancel = Cancellation()

    async def waits() -> tuple[bool, bool]:
        quick = await cancel.wait_async(0.01)
        threading.Timer(0.05, cancel.set, args=("timeout",)).start()
        return quick, await cancel.wait_async(5)

    assert asyncio.run(waits()) == (False, True)


def test_a_hook_registered_after_the_signal_runs_at_once_and_hooks_run_once() -> None:
    cancel, calls = Cancellation(), []
    cancel.on_set(lambda: calls.append("early"))
    cancel.set("timeout")
    cancel.set("shutdown")
    cancel.on_set(lambda: calls.append("late"))
    assert calls == ["early", "late"] and cancel.reason == "timeout"


def test_a_pool_needs_a_thread() -> None:
    with pytest.raises(ValueError, match="at least one thread"):
        Pool("z", 2, threads=0)


def test_threads_blocked_in_sync_jobs_do_not_stall_a_pool_of_deferred_runs(
        loop: EventLoop) -> None:
    """After many deferred runs, sync jobs that block some threads leave the deferred runs
    submitted with them to the other threads."""
    pool, bodies = Pool("b", 40, threads=24), Bodies()
    pool.stage_max = 200
    warm, warm_done = collect()
    for _ in range(150):
        pool.try_submit(deferred(loop, partial(bodies.body, 0.0)), warm_done)
    eventually(lambda: len(warm) == 150, 10)
    gate, seen = threading.Event(), collect()
    try:
        jobs = [Submission(lambda: gate.wait(10), seen[1], None, {}, None, 0.0)
                for _ in range(12)]  # more than the spare threads, in one batch
        jobs += [Submission(deferred(loop, partial(bodies.body, 0.0, i)), seen[1], None, {},
                            None, 0.0) for i in range(5)]
        assert pool.submit_reserved(jobs)
        eventually(lambda: len(seen[0]) == 5, 5, "the deferred runs behind the blocked threads")
        assert {o.value for o in seen[0]} == set(range(5))
    finally:
        gate.set()
    eventually(lambda: len(seen[0]) == 17, 10)


def test_short_waits_in_a_loop_keep_no_hook_each() -> None:
    cancel = Cancellation()

    async def waits() -> None:
        for _ in range(20):
            assert not await cancel.wait_async(0.001)

    asyncio.run(waits())
    assert not cancel._hooks


# -- runs started on the loop (a pool fed to the event loop) -------------------------------

def on_loop(loop: EventLoop, body: Callable[[], Any], threads: set[str],
            cancel: Cancellation | None = None) -> Callable[[], Deferred]:
    """A job function for the feed: records which thread called it, and starts ``body``
    from there (``run_here``: the loop's own thread)."""
    def fn() -> Deferred:
        threads.add(threading.current_thread().name)
        return Deferred(lambda ended: loop.run_here(body, ended, cancel))
    return fn


def test_a_fed_pool_starts_on_loop_jobs_on_the_loops_thread_within_its_slots(
        loop: EventLoop) -> None:
    pool, bodies, threads = Pool("fed", 5, threads=2), Bodies(), set[str]()
    pool.attach_feed(loop.feed(pool))
    seen, done = collect()
    jobs = [Submission(on_loop(loop, partial(bodies.body, 0.05, i), threads), done, None, {},
                       None, 0.0, True) for i in range(40)]
    assert pool.submit_reserved(jobs)  # 40 on 5 slots: the rest staged, reserved
    eventually(lambda: len(seen) == 40, timeout=10)
    assert threads == {"test-loop"}  # no pool thread called a job
    assert bodies.started == 40 and bodies.most == 5  # the slots bound them, and were used
    assert sorted(o.value for o in seen) == list(range(40)) and all(o.ok for o in seen)
    assert pool.busy == 0 and pool.active == 0 and pool.staged == 0


def test_a_fed_job_waits_for_its_start_time_and_a_cancelled_one_leaves_at_once(
        loop: EventLoop) -> None:
    pool, bodies, threads = Pool("fed", 4), Bodies(), set[str]()
    pool.attach_feed(loop.feed(pool))
    seen, done = collect()
    later, cancel = pool.clock() + 0.3, Cancellation()
    jobs = [Submission(on_loop(loop, partial(bodies.body, 0.0, "late"), threads), done, None,
                       {}, None, later, True),
            Submission(on_loop(loop, partial(bodies.body, 0.0, "far"), threads, cancel), done,
                       None, {}, cancel, pool.clock() + 60, True)]
    assert pool.submit_reserved(jobs)
    assert pool.staged == 2 and bodies.started == 0
    eventually(lambda: len(seen) == 1, timeout=5)
    assert seen[0].value == "late" and pool.clock() >= later  # not before its start time
    cancel.set("cancelled")
    pool.release_cancelled()  # taken now, not in 60 s: its function sees the signal
    eventually(lambda: len(seen) == 2, timeout=5)
    assert pool.staged == 0 and pool.busy == 0


def test_abandon_reports_the_fed_jobs_still_staged_and_none_starts_after(
        loop: EventLoop) -> None:
    pool, bodies, threads = Pool("fed", 1), Bodies(), set[str]()
    pool.attach_feed(loop.feed(pool))
    seen, done = collect()
    jobs = [Submission(on_loop(loop, partial(bodies.body, 10.0, i), threads), done, None, {},
                       None, 0.0, True) for i in range(3)]
    assert pool.submit_reserved(jobs)
    eventually(lambda: bodies.started == 1, timeout=5)
    assert pool.abandon("test") == 3  # the running one and the two staged
    assert len(seen) == 3 and all(o.abandoned == "test" for o in seen)
    assert pool.staged == 0
    pool.close()
    loop.stop()  # the running body is cancelled; the staged two never start
    assert bodies.started == 1


def test_without_a_feed_an_on_loop_job_is_taken_by_a_thread(loop: EventLoop) -> None:
    pool, bodies, threads = Pool("unfed", 2), Bodies(), set[str]()
    seen, done = collect()

    def fn() -> Deferred:
        threads.add(threading.current_thread().name)
        return Deferred(lambda ended: loop.run(partial(bodies.body, 0.0, "ok"), ended))
    assert pool.submit_reserved([Submission(fn, done, None, {}, None, 0.0, True)])
    eventually(lambda: len(seen) == 1, timeout=5)
    assert seen[0].value == "ok" and threads and all(t.startswith("ax-unfed") for t in threads)
