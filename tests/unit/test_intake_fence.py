"""A run fenced under an incarnation that was then declared dead never starts, even when its
receipt batch comes back after the worker withdrew its stage (the race a SIGSTOP found);
and the place the starter gives each staged run is the order its pool's thread takes them."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from kombu import Queue

from ax_kombu.broker.messages import TaskMessage
from ax_kombu.core.lease import Lease
from ax_kombu.worker.control import StopFlags, Wakeup
from ax_kombu.worker.counters import Counters
from ax_kombu.worker.intake import Intake
from ax_kombu.worker.lanes import Lane
from ax_kombu.worker.receipts import Batch
from ax_kombu.worker.run import Run, State
from ax_kombu.worker.task import RunTask

pytestmark = pytest.mark.timeout(30)


class Message:
    def ack(self) -> None:
        pass


class Calls:
    """The result writer and the resolver; ``kind`` "async": the processor is an ``async
    def`` (its runs start on the worker's event loop, not on a pool thread)."""

    def __init__(self, kind: str = "sync") -> None:
        self.runs: list[tuple[int, int]] = []
        self.results: list[int] = []
        self.kind = kind
        self.threads: set[str] = set()

    def put(self, task: TaskMessage, outcome: Any,
            on_durable: Any = None) -> None:  # the result writer: durable at once
        self.results.append(task.task_id)
        if on_durable is not None:
            on_durable()

    def resolve(self, processor: str | None, url: str | None) -> Any:  # the resolver
        return self._async_run if self.kind == "async" else self._run

    def _run(self, payload: Any, ctx: Any) -> None:
        self.threads.add(threading.current_thread().name)
        self.runs.append((ctx.task_id, ctx.attempt))

    async def _async_run(self, payload: Any, ctx: Any) -> None:
        self._run(payload, ctx)


class Receipts:
    full = False
    in_flight = 0

    def take(self) -> None:
        return None


def _intake(calls: Calls, lease: Lease, size: int = 2) -> tuple[Intake, Lane]:
    wakeup = Wakeup()
    lane = Lane("default", Queue("q"), size, 1, wakeup.poke, 1.0)
    intake = Intake([lane], receipts=Receipts(), results=calls,  # type: ignore[arg-type]
                    resolver=calls, stats=Counters(), wakeup=wakeup,  # type: ignore[arg-type]
                    flags=StopFlags(), clock=lambda: time.time() * 1000, lease=lease)
    return intake, lane


def _batch(intake: Intake, lane: Lane, task_id: int, incarnation: int,
           due_in_ms: int = -10) -> Batch:
    now = int(time.time() * 1000)
    task = TaskMessage(task_id, 1, "t", {}, "tr", now + due_in_ms, 60_000, "default", 0, 3,
                       "p", None, now, "s0")
    lane.reserved += 1  # as plan() does
    planned = Run(lane=lane, task=task, message=Message(), generation=intake.acks.generation,
                  state=State.PLANNED)
    fenced = RunTask(task_id=task_id, attempt=1, task_type="t", payload={}, trace_id="tr",
                     trigger_time=now + due_in_ms, timeout_ms=60_000, priority="default",
                     retry_count=0, max_retry=3, processor="p", callback_url=None,
                     dispatched_at=now, node="s0")  # the row's task, as the RUNNING move read it
    return Batch(start=[planned], release=[], dupes=[],
                 started={task_id: fenced}, incarnation=incarnation)


def _settle_until(intake: Intake, done: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Settle as the consuming thread does, every 10 ms, until ``done()`` or ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        intake.settle()
        time.sleep(0.01)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_batch_fenced_before_the_worker_was_declared_dead_is_not_started(kind: str) -> None:
    calls, lease = Calls(kind), Lease(5.0)
    lease.confirm(time.monotonic(), incarnation=1)
    intake, lane = _intake(calls, lease)
    late = _batch(intake, lane, 42, incarnation=1)  # committed before the pause
    # after SIGCONT, Worker._fenced: revoke, withdraw the stage (empty yet), register anew ...
    lease.revoke()
    assert intake.withdraw() == []
    intake.planner.receipted(late)  # ... while the consuming thread takes the batch that came back
    lease.confirm(time.monotonic(), incarnation=2)
    fresh = _batch(intake, lane, 43, incarnation=2)  # fenced under the new incarnation
    intake.planner.receipted(fresh)
    _settle_until(intake, lambda: not (intake.stage.runs or lane.pool.active))
    assert calls.runs == [(43, 1)]  # the old incarnation's run never started ...
    assert calls.results == [43]    # ... and recorded nothing (the row is recovered)
    if kind == "async":  # started on the event loop, without a pool thread
        assert calls.threads == {"ax-event-loop"}
    lane.pool.close()
    intake.starter.stop()


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_run_whose_timeout_passes_while_it_waits_is_kept_for_hand_back(kind: str) -> None:
    """The lease stays uncertain (heartbeats failing) past the run's timeout: the run never
    starts and records no outcome, and it is not dropped either: the node hands its row
    back (before, it stayed RUNNING on a live node for good)."""
    calls, lease = Calls(kind), Lease(5.0)  # never confirmed: covers() stays undecided
    intake, lane = _intake(calls, lease)
    batch = _batch(intake, lane, 44, incarnation=1)
    waiting = batch.start[0]
    assert batch.started is not None  # the row's settings are what runs
    batch.started[44].timeout_ms = 200
    intake.planner.receipted(batch)
    _settle_until(intake, lambda: not intake.stage.runs, 10.0)
    assert not intake.stage.runs
    assert calls.runs == [] and calls.results == []  # never started, nothing recorded
    assert intake.starter.take_expired() == [waiting]
    assert intake.starter.take_expired() == []
    intake.starter.stop()


def test_an_async_run_waits_for_an_uncertain_lease_off_the_loop_then_starts() -> None:
    """On the loop, a run whose lease is not known yet waits on a thread of the starter's
    (the loop goes on), and starts once a beat confirms the lease."""
    calls, lease = Calls("async"), Lease(5.0)
    intake, lane = _intake(calls, lease)
    intake.planner.receipted(_batch(intake, lane, 45, incarnation=1))
    _settle_until(intake, lambda: False, 0.3)  # settle for 0.3 s
    assert calls.runs == []  # the lease is not known: not started
    lease.confirm(time.monotonic(), incarnation=1)
    _settle_until(intake, lambda: not intake.stage.runs, 10.0)
    assert calls.runs == [(45, 1)] and calls.results == [45]
    lane.pool.close()
    intake.starter.stop()


class RecordedMessage(Message):
    acks = 0

    def ack(self) -> None:
        self.acks += 1


def test_a_message_is_acked_only_once_its_outcome_is_durable() -> None:
    """The run ends, its outcome waits for its batch's commit: the message stays unacked
    (a worker killed meanwhile leaves it to the broker and the row RUNNING to recovery)."""
    calls, lease = Calls(), Lease(5.0)
    lease.confirm(time.monotonic(), incarnation=1)
    durable: list[Any] = []
    calls.put = lambda task, outcome, on_durable=None: durable.append(on_durable)  # type: ignore[method-assign]
    intake, lane = _intake(calls, lease)
    batch = _batch(intake, lane, 45, incarnation=1)
    message = RecordedMessage()
    batch.start[0].message = message
    intake.planner.receipted(batch)
    deadline = time.monotonic() + 5
    while not durable and time.monotonic() < deadline:
        time.sleep(0.01)
    assert calls.runs == [(45, 1)] and len(durable) == 1
    intake.settle()
    assert message.acks == 0 and intake.stage.runs  # ended, not durable yet
    durable[0]()  # the writer committed the batch
    intake.settle()
    assert message.acks == 1 and not intake.stage.runs


def test_a_run_its_pool_gives_up_on_before_it_starts_ends_unstarted_and_is_settled() -> None:
    """The pool abandons a run whose thread still waits for the lease (a stop that timed
    out): the run ends ABANDONED, records nothing (its row is the recovery's), is settled
    and acked, and its thread never calls the processor."""
    calls, lease = Calls(), Lease(5.0)  # never confirmed: the thread waits for the lease
    intake, lane = _intake(calls, lease)
    batch = _batch(intake, lane, 46, incarnation=1)
    run = batch.start[0]
    message = RecordedMessage()
    run.message = message
    intake.planner.receipted(batch)
    deadline = time.monotonic() + 5
    while lane.pool.staged and time.monotonic() < deadline:  # a thread takes it, and waits
        time.sleep(0.01)
    assert lane.pool.abandon("worker shut down before the task finished") == 1
    while intake.stage.runs and time.monotonic() < deadline:
        intake.settle()
        time.sleep(0.01)
    assert run.state is State.SETTLED and message.acks == 1
    assert calls.runs == [] and calls.results == []
    lane.pool.close()



class Gated(Calls):
    """A processor that holds its thread, for task 60, until :attr:`gate` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.holding = threading.Event()

    def _run(self, payload: Any, ctx: Any) -> None:
        if ctx.task_id == 60:
            self.holding.set()
            self.gate.wait(10)
        super()._run(payload, ctx)


def _receipted(intake: Intake, lane: Lane, dues: dict[int, int]) -> list[Run[Lane]]:
    """Fence and submit one batch of runs due ``dues[task_id]`` ms from now."""
    batches = [_batch(intake, lane, task_id, 1, due_in_ms) for task_id, due_in_ms in dues.items()]
    runs = [batch.start[0] for batch in batches]
    intake.planner.receipted(Batch(start=runs, release=[], dupes=[], incarnation=1,
                                   started={k: v for b in batches
                                            for k, v in (b.started or {}).items()}))
    return runs


def test_due_runs_are_taken_earliest_trigger_first_in_the_order_the_run_names() -> None:
    """:attr:`Run.order` (what the listing's scan sorts by) names the runs in the order the
    lane's thread starts them, and that is the earliest trigger time first, due ones too: a
    run already due when it arrives does not go ahead of one staged before its own trigger
    time (it did, keyed "at once": under a steady backlog the staged one waited as long as
    late runs kept coming)."""
    calls, lease = Gated(), Lease(5.0)
    lease.confirm(time.monotonic(), incarnation=1)
    intake, lane = _intake(calls, lease, size=1)
    first = _receipted(intake, lane, {60: -10, 61: 50, 62: 300, 63: 120})
    assert calls.holding.wait(5)  # 60 holds the lane's one thread
    due_61 = first[1].task.trigger_time
    while time.time() * 1000 < due_61 + 40:  # 61 is due, and so are the runs that come now
        time.sleep(0.005)
    later = _receipted(intake, lane, {64: -10, 65: -30})  # due after 61, before 63 and 62
    calls.gate.set()
    _settle_until(intake, lambda: len(calls.results) == 6)
    taken = [task_id for task_id, _ in calls.runs]
    triggers = {r.task.task_id: r.task.trigger_time for r in first + later}
    assert taken[0] == 60 and sorted(taken) == sorted(triggers)
    assert [triggers[t] for t in taken[1:]] == sorted(triggers[t] for t in taken[1:])
    assert taken == [r.task.task_id for r in sorted(first + later, key=lambda r: r.order)]
    lane.pool.close()
    intake.starter.stop()
