"""Bounded pools: refusal when full, one outcome per job, timeouts that keep their slot."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from ax_kombu.worker.pools import Outcome, Pool, Submission
from ax_kombu.worker.processors import Cancellation
from tests.waiting import eventually

pytestmark = pytest.mark.timeout(30)


class Outcomes:
    """Collects every outcome reported, with the job it belongs to."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.items: list[tuple[str, Outcome]] = []

    def done(self, name: str) -> Callable[[Outcome], None]:
        def record(outcome: Outcome) -> None:
            with self.lock:
                self.items.append((name, outcome))
        return record

    def of(self, name: str) -> list[Outcome]:
        with self.lock:
            return [o for n, o in self.items if n == name]


@pytest.fixture
def gate() -> Iterator[threading.Event]:
    event = threading.Event()
    yield event
    event.set()  # never leave a pool thread blocked after a test


def blocker(gate: threading.Event, result: Any = "ok") -> Callable[[], Any]:
    def job() -> Any:
        gate.wait(10)
        return result
    return job


def test_submit_beyond_capacity_is_refused_and_free_slots_are_counted(
        gate: threading.Event) -> None:
    pool, seen = Pool("t", 2), Outcomes()
    assert pool.free == 2
    assert pool.try_submit(blocker(gate, 1), seen.done("a"))
    assert pool.try_submit(blocker(gate, 2), seen.done("b"))
    assert pool.free == 0 and pool.busy == 2
    assert not pool.try_submit(blocker(gate), seen.done("c"))
    gate.set()
    eventually(lambda: pool.free == 2)
    assert [o.value for o in seen.of("a")] == [1] and [o.value for o in seen.of("b")] == [2]
    assert seen.of("c") == []
    pool.close()


def test_reserved_jobs_submitted_together_all_run_in_start_order_and_wake_idle_threads(
        gate: threading.Event) -> None:
    pool, seen = Pool("t", 2), Outcomes()
    order: list[str] = []
    soon = time.monotonic() + 0.05
    jobs = [Submission(lambda n=n: order.append(n), seen.done(n), None, {}, None, at)
            for n, at in (("later", soon + 0.05), ("first", 0.0), ("soon", soon))]
    assert pool.submit_reserved(jobs)  # beyond the 2 slots: the caller reserved their room
    eventually(lambda: len(seen.items) == 3)
    assert order[-1] == "later" and order.index("first") < order.index("soon")
    assert all(o.ok for _, o in seen.items)
    pool.close()
    assert not pool.submit_reserved(jobs[:1])  # closed: nothing staged
    assert len(seen.items) == 3


def test_an_exception_is_the_jobs_outcome_and_the_thread_survives() -> None:
    pool, seen = Pool("t", 1), Outcomes()

    def boom() -> None:
        raise KeyError("missing")

    assert pool.try_submit(boom, seen.done("boom"))
    eventually(lambda: len(seen.of("boom")) == 1 and pool.free == 1)
    outcome = seen.of("boom")[0]
    assert not outcome.ok and isinstance(outcome.error, KeyError)
    assert pool.try_submit(lambda: 5, seen.done("next"))
    eventually(lambda: [o.value for o in seen.of("next")] == [5])
    pool.close()


def test_a_timed_out_job_is_signalled_and_reported_only_when_its_thread_returns(
        gate: threading.Event) -> None:
    """Its task must not be retried while it still runs: no outcome before it returns."""
    pool, seen, cancel = Pool("t", 2), Outcomes(), Cancellation()
    started = time.monotonic()
    assert pool.try_submit(blocker(gate), seen.done("slow"), timeout_s=0.1, cancel=cancel)
    eventually(lambda: cancel.is_set())
    assert cancel.reason == "timeout" and 0.1 <= time.monotonic() - started < 2.0
    assert pool.overdue == 1 and pool.timeouts == 1
    assert seen.of("slow") == []  # still running: nothing reported, the slot stays taken
    assert pool.busy == 1 and pool.free == 1 and pool.active == 1
    assert pool.try_submit(blocker(gate), seen.done("other"))
    assert not pool.try_submit(lambda: None, seen.done("refused"))  # full: 1 overdue + 1 running
    gate.set()
    eventually(lambda: pool.free == 2 and len(seen.of("slow")) == 1)
    outcome = seen.of("slow")[0]
    assert outcome.timed_out and not outcome.ok  # what it returned late is not a success
    assert pool.overdue == 0 and pool.late_returns == 1
    pool.close()


def test_a_job_that_watches_its_cancellation_returns_at_its_timeout() -> None:
    pool, seen, cancel = Pool("t", 1), Outcomes(), Cancellation()
    assert pool.try_submit(lambda: cancel.wait(10), seen.done("polite"), timeout_s=0.05,
                           cancel=cancel)
    eventually(lambda: len(seen.of("polite")) == 1, timeout=2.0)
    assert seen.of("polite")[0].timed_out and pool.free == 1
    pool.close()


def test_a_job_that_ends_in_time_is_not_reported_as_timed_out() -> None:
    pool, seen = Pool("t", 1), Outcomes()
    assert pool.try_submit(lambda: "quick", seen.done("q"), timeout_s=5.0)
    eventually(lambda: len(seen.of("q")) == 1 and pool.free == 1)
    assert seen.of("q")[0].ok and not seen.of("q")[0].timed_out and pool.timeouts == 0
    pool.close()


def test_abandon_reports_running_jobs_once_and_join_no_longer_waits_for_them(
        gate: threading.Event) -> None:
    pool, seen = Pool("t", 2), Outcomes()
    assert pool.try_submit(blocker(gate), seen.done("a"))
    assert not pool.join(0.05)
    assert pool.abandon("shutdown") == 1
    assert seen.of("a")[0].abandoned == "shutdown"
    assert pool.join(0.05)
    assert pool.busy == 1  # the thread still runs and keeps its slot
    gate.set()
    eventually(lambda: pool.busy == 0)
    assert len(seen.of("a")) == 1
    pool.close()


def test_pools_are_isolated(gate: threading.Event) -> None:
    slow, fast, seen = Pool("slow", 1), Pool("fast", 1), Outcomes()
    assert slow.try_submit(blocker(gate), seen.done("slow"))
    assert not slow.try_submit(lambda: None, seen.done("refused"))
    assert fast.try_submit(lambda: "fast", seen.done("fast"))
    eventually(lambda: len(seen.of("fast")) == 1, timeout=2.0)
    assert seen.of("slow") == []
    gate.set()
    eventually(lambda: slow.free == 1)
    slow.close()
    fast.close()


def test_the_slot_is_free_when_the_outcome_is_reported() -> None:
    """Whoever the report wakes (the worker acks and is handed the next message) finds
    the slot free: it must not hand that message back for want of a slot."""
    pool, free_at_report = Pool("t", 1), []
    for _ in range(3):
        seen = threading.Event()

        def done(outcome: Outcome, seen: threading.Event = seen) -> None:
            free_at_report.append(pool.free)
            seen.set()
        assert pool.try_submit(lambda: None, done)
        assert seen.wait(5)
    assert free_at_report == [1, 1, 1]
    assert pool.join(1.0)
    pool.close()


def test_release_hook_runs_when_an_abandoned_job_returns(gate: threading.Event) -> None:
    freed: list[int] = []
    pool, seen = Pool("t", 1, on_release=lambda: freed.append(pool.free)), Outcomes()
    assert pool.try_submit(lambda: None, seen.done("quick"))
    eventually(lambda: len(seen.of("quick")) == 1 and pool.free == 1)
    assert freed == []  # a reported outcome wakes its caller through done, not the hook
    cancel = Cancellation()
    assert pool.try_submit(blocker(gate), seen.done("slow"), cancel=cancel)
    eventually(lambda: pool.staged == 0)  # a thread took it (a staged job would never start)
    assert pool.abandon("shutdown") == 1
    assert seen.of("slow")[0].abandoned and cancel.reason == "shutdown"
    assert pool.free == 0 and pool.stuck == 1 and freed == []
    gate.set()
    eventually(lambda: freed == [1])
    pool.close()


def test_a_closed_pool_refuses_work() -> None:
    pool, seen = Pool("t", 1), Outcomes()
    pool.close()
    assert pool.free == 0
    assert not pool.try_submit(lambda: None, seen.done("x"))


def test_a_pool_needs_a_slot() -> None:
    with pytest.raises(ValueError):
        Pool("t", 0)


def test_staged_jobs_wait_for_a_thread_and_run_in_order_without_the_caller(
        gate: threading.Event) -> None:
    pool, seen, order = Pool("t", 1), Outcomes(), []
    pool.stage_max = 2
    assert pool.try_submit(blocker(gate, "first"), seen.done("first"))
    for name in ("a", "b"):
        assert pool.try_submit(lambda name=name: order.append(name), seen.done(name))
    assert pool.room == 0 and not pool.try_submit(lambda: None, seen.done("refused"))
    assert pool.staged >= 2 and pool.active == 3
    gate.set()  # the thread takes the staged jobs one after the other, nobody hands them over
    eventually(lambda: order == ["a", "b"] and pool.active == 0 and pool.room == 3)
    assert seen.of("refused") == [] and all(o.ok for _, o in seen.items)
    pool.close()


def test_a_reserved_job_is_staged_even_after_the_stage_shrank(gate: threading.Event) -> None:
    pool, seen = Pool("t", 1), Outcomes()
    assert pool.try_submit(blocker(gate), seen.done("running"))
    pool.stage_max = 0  # shrank between planning and submitting
    assert not pool.try_submit(lambda: None, seen.done("unplanned"))
    assert pool.try_submit(lambda: "late", seen.done("planned"), reserved=True)
    gate.set()
    eventually(lambda: [o.value for o in seen.of("planned")] == ["late"])
    pool.close()


def test_a_staged_jobs_timeout_starts_when_a_thread_takes_it(gate: threading.Event) -> None:
    pool, seen, cancel = Pool("t", 1), Outcomes(), Cancellation()
    pool.stage_max = 1
    assert pool.try_submit(blocker(gate), seen.done("first"))
    assert pool.try_submit(lambda: time.sleep(0.05), seen.done("staged"), timeout_s=0.3,
                           cancel=cancel)
    time.sleep(0.5)  # staged for longer than its timeout: that time does not count
    gate.set()
    eventually(lambda: len(seen.of("staged")) == 1)
    outcome = seen.of("staged")[0]
    assert outcome.ok and not outcome.timed_out and not cancel
    pool.close()


def test_abandoning_a_pool_reports_its_staged_jobs_and_never_starts_them(
        gate: threading.Event) -> None:
    pool, seen, ran = Pool("t", 1), Outcomes(), []
    pool.stage_max = 1
    assert pool.try_submit(blocker(gate), seen.done("running"))
    eventually(lambda: pool.staged == 0)
    assert pool.try_submit(lambda: ran.append(1), seen.done("staged"))
    assert pool.abandon("shutdown") == 2
    assert seen.of("staged")[0].abandoned == "shutdown" and pool.staged == 0
    gate.set()
    eventually(lambda: pool.free == 1)
    time.sleep(0.05)  # the thread is free: it would have taken the staged job by now
    assert ran == [] and len(seen.of("staged")) == 1
    pool.close()


def test_a_staged_job_waits_for_its_start_time_without_a_thread_and_earlier_ones_go_first(
        ) -> None:
    pool, order = Pool("t", 1), []
    pool.stage_max = 3
    now = time.monotonic()
    assert pool.try_submit(lambda: order.append("late"), lambda o: None, start_at=now + 0.3)
    assert pool.try_submit(lambda: order.append("soon"), lambda o: None, start_at=now + 0.1)
    assert pool.try_submit(lambda: order.append("due"), lambda o: None)  # the one thread is free
    eventually(lambda: order == ["due"])
    eventually(lambda: order == ["due", "soon", "late"])
    assert time.monotonic() >= now + 0.3
    pool.close()


def test_a_cancelled_staged_job_leaves_the_stage_before_its_start_time() -> None:
    pool, seen, cancel = Pool("t", 1), Outcomes(), Cancellation()
    pool.stage_max = 1
    assert pool.try_submit(lambda: "ran", seen.done("held"), cancel=cancel,
                           start_at=time.monotonic() + 60)
    cancel.set("cancelled")
    pool.release_cancelled()
    eventually(lambda: len(seen.of("held")) == 1 and pool.active == 0, timeout=2.0)
    pool.close()


class CountingCondition(threading.Condition):
    """A condition that counts the waits that returned (a thread woken, or timed out)."""

    def __init__(self, lock: Any = None) -> None:
        super().__init__(lock)
        self.returns = 0

    def wait(self, timeout: float | None = None) -> bool:
        try:
            return super().wait(timeout)
        finally:
            self.returns += 1  # the lock is held again here


def test_a_finished_sync_run_wakes_no_idle_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """In a lane of sync runs the idle threads already wait for the next start time: a run
    that finishes wakes none of them (one wake-up per run, a measurable cost in a steady
    stream), while a slot a deferred run frees does wake one (test_async_pools)."""
    monkeypatch.setattr(threading, "Condition", CountingCondition)
    pool, seen = Pool("t", 4), Outcomes()
    monkeypatch.undo()
    work = pool._work
    assert isinstance(work, CountingCondition)
    eventually(lambda: pool._idle == 4)
    release = threading.Event()
    assert pool.submit_reserved([
        Submission(lambda: release.wait(5), seen.done("run"), None, {}, None, 0.0),
        Submission(lambda: None, seen.done("later"), None, {}, None, time.monotonic() + 3.0)])
    eventually(lambda: pool._idle == 3 and len(pool._running) == 1)
    before = work.returns
    release.set()
    eventually(lambda: len(seen.of("run")) == 1)
    watch_until = time.monotonic() + 0.3  # a window to see a wake-up that should not come
    while time.monotonic() < watch_until:
        assert work.returns == before, "a finished run woke an idle thread"
        time.sleep(0.01)
    eventually(lambda: len(seen.of("later")) == 1)  # the staged job still starts on time
    pool.close()
