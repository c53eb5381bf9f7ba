"""The intake: received messages → receipt batches → pool runs → acks, on the consuming thread.

The consumer (:mod:`ax_kombu.worker.consumer`) appends what it receives to
:attr:`Intake.pending`; once per loop the intake plans it and settles what
came back:

1. each message is planned into its lane's pool — a free thread, or the
   lane's *stage* (runs fenced ahead of a free thread, bounded: see
   :mod:`ax_kombu.worker.lanes`); what cannot be taken waits in the lane's
   backlog (only with ``prefetch_multiplier`` > 1), else is handed back
   (:func:`~ax_kombu.worker.lanes.plan`);
2. the receipt stage (:mod:`ax_kombu.worker.receipts`, its own threads) moves the
   startable tasks DISPATCHING → RUNNING in ONE statement, only where the
   row's attempt equals the message's (the fencing token), setting
   ``started_at`` (database clock) and ``owner_node`` = this worker, and
   returning each started row: its processor, callback_url, payload, timeout
   and retry settings are what runs, not the message's copies (a message
   that differs is counted as forged); the
   handed-back ones go DISPATCHING → READY with ``owner_node`` NULL.
   Meanwhile the consuming thread keeps draining, so the next batch is what
   arrived during this one's round trip (at most ``worker_batch_size``);
3. a message whose move failed (task cancelled, or a stale message from an
   earlier attempt) is logged with the reason, counted, acked, not run;
4. the started tasks go to their pools, where a thread that finishes a run
   takes the next staged one with no round trip in between; each outcome is
   written in a batch by :class:`~ax_kombu.worker.results.ResultWriter`, and
   its message is acked.

**Before a run starts** (on its pool thread) it is checked once more, in
memory: it must still be staged (not cancelled, not withdrawn by a stop) and
the worker's :class:`~ax_kombu.core.lease.Lease` must cover the
incarnation that fenced it — a worker
whose heartbeats stopped succeeding (cut off, or paused past its silence
window) starts nothing it staged until a beat succeeds, and one declared dead
meanwhile withdraws its stage (another node has those tasks now).

**Staged tasks.** The scheduler claims and publishes a task up to
``claim_lead_ms`` before its trigger time, so that the round trips between the
due time and the start (claim, publish, receive, and above all the RUNNING
commit, whose disk flush now and then takes a hundred milliseconds or more)
are done ahead of it. A task received early is fenced (RUNNING) at once and
waits in its pool's stage, holding no thread, until its trigger time on the
database clock: it never starts early, and the ``started_at`` its result
records is when it really started. Staging is bounded by the lane's stage. While
held it is a running task like any other: ``ax cancel`` stops it before it
starts; a stopping worker (warm or cold) withdraws the held runs that have not
started (:meth:`Intake.withdraw_staged`) and hands them back; a worker killed
meanwhile leaves them RUNNING on a dead node, and the recovery gives them
another attempt (they never ran, so nothing ran twice). The runs a lane will not
reach soon are written down as *held* (:mod:`ax_kombu.worker.holds`), so that
recovery gives those a new attempt without counting a retry; a thread that
reaches a held run has it released first (one commit).

A message is acked only after its RUNNING move committed, and normally
stays unacked while its task is staged or runs: the broker's prefetch (the
lane's window: threads and stage) then bounds exactly what a lane holds, so
a worker is only handed work it can start soon and nothing waits in an
unbounded queue. See
:mod:`ax_kombu.worker.lanes` for the runs that hold a slot without a message
(timed-out threads, tasks allowed over ten minutes) and how the prefetch
shrinks for them.

Acks are only valid on the connection a message came on: each connection is
a *generation* (:meth:`Intake.connected`), and an ack for an earlier one is
skipped. Everything here runs on the consuming thread except
:meth:`Intake._done`, which pool threads call.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any

from ax_kombu.broker import redis_pull
from ax_kombu.broker.messages import TaskMessage
from ax_kombu.core.lease import Lease
from ax_kombu.exceptions import ProcessorRefused
from ax_kombu.observability import metrics
from ax_kombu.worker.control import StopFlags, Wakeup
from ax_kombu.worker.counters import Counters
from ax_kombu.worker.holds import HOLD_AFTER_S, Holds
from ax_kombu.worker.lanes import ACK_AT_START_MS, Delivery, Lane, plan
from ax_kombu.worker.pools import Outcome, Pool, Submission
from ax_kombu.worker.processors import Cancellation, Context, Resolver, call
from ax_kombu.worker.receipts import Batch, ReceiptWriter, UnreadablePayload, account
from ax_kombu.worker.results import ResultWriter

#: how long a staged run waits for the lease before looking at its signal again
LEASE_WAIT_S = 0.1


class Withdrawn(Exception):
    """A staged run ended before its trigger time without starting: cancelled (``ax
    cancel``; the row is CANCELLED) or withdrawn by a stopping worker (which writes the
    row back itself). Nothing is recorded for it."""


class Intake:
    """Plans received deliveries, starts the receipted ones, acks what has ended.

    Args:
        lanes: the lanes consumed, in the order the consumer and puller number them.
        receipts: the receipt stage the batches go to.
        results: where each run's outcome goes.
        resolver: how a task's processor name resolves to a function.
        wakeup: rung when a run ends.
        flags: while stopping, lanes' prefetch is left as it is (consumers stay cancelled).
        clock: the earliest the database time can be, epoch ms, without a round trip
            (:meth:`~ax_kombu.store.clock.DbClock.earliest_ms`): a staged task is held
            until it reaches the task's trigger time.
        lease: a staged run starts only while the worker's incarnation is certainly live.
        batch_size: the most RUNNING moves one receipt batch makes.
        now_ms: the database time a run's start is recorded at (default ``clock``); the
            result writer records its end on the same clock.
        holds: where the runs a lane will not reach soon are written down as held (None:
            none are, and a dead worker's RUNNING tasks all count as started).
    """

    def __init__(self, lanes: list[Lane], receipts: ReceiptWriter, results: ResultWriter,
                 resolver: Resolver, stats: Counters, wakeup: Wakeup, flags: StopFlags,
                 clock: Callable[[], float], lease: Lease, batch_size: int = 500,
                 now_ms: Callable[[], float] | None = None,
                 holds: Holds | None = None) -> None:
        self.lanes = lanes
        self._holds = holds
        self.receipts = receipts
        self._results = results
        self._resolver = resolver
        self._stats = stats
        self._wakeup = wakeup
        self._flags = flags
        self._clock = clock
        self._now_ms = now_ms or clock
        #: runs handed to a pool and not started yet (staged, or held before their
        #: trigger time); a run starts only if it is still here
        self._staged: set[Delivery] = set()
        self._staged_lock = threading.Lock()
        self._lease = lease
        #: received and not planned yet; the consumer appends, this list object stays the same
        self.pending: list[Delivery] = []
        #: planned batches (their slots reserved) waiting for a free receipt writer
        self._planned: deque[Batch] = deque()
        self._batch_size = batch_size
        #: submitted to a pool and not settled yet
        self.running: set[Delivery] = set()
        #: the latest trigger time of any run submitted (epoch ms): none is held once the
        #: clock has passed it, so the hold watch need not look
        self.latest_trigger = 0
        #: runs whose timeout passed while they were held (the lease stayed uncertain, say)
        #: and so never started: their rows are still RUNNING here at their attempt, and
        #: the node hands them back (:meth:`take_expired_holds`), or the recovery does
        self.expired_holds: queue.SimpleQueue[Delivery] = queue.SimpleQueue()
        self._completed: queue.SimpleQueue[Delivery] = queue.SimpleQueue()
        #: the current broker connection (acks for an earlier one are void)
        self.generation = 0
        self.global_qos = False
        self._puller: redis_pull.Puller | None = None
        #: acks per lane not yet reported to the puller
        self._released = [0] * len(lanes)
        #: RabbitMQ: this loop's acks per lane, sent together by flush_acks()
        self._acks: dict[Lane, list[Delivery]] = {}
        #: RabbitMQ: each lane's planned deliveries in arrival (delivery tag) order; the
        #: acked ones are dropped from the left as flush_acks() finds them
        self._arrived: dict[Lane, deque[Delivery]] = {lane: deque() for lane in lanes}

    # -- the connection ------------------------------------------------------------------------

    def connected(self, global_qos: bool, puller: redis_pull.Puller | None) -> int:
        """A new broker connection: returns its generation, which its deliveries carry.

        Args:
            global_qos: set the prefetch per channel (RabbitMQ).
            puller: when a puller receives, it is told of the room acks free.
        """
        self.generation += 1
        self.global_qos = global_qos
        self._puller = puller
        self._released = [0] * len(self.lanes)
        self._forget_acks()
        return self.generation

    def disconnected(self) -> None:
        """The connection is closed: no more room is reported to its puller."""
        self._puller = None

    def connection_lost(self) -> None:
        """After a lost connection: unacked messages are the broker's again."""
        self.generation += 1  # acks for the lost connection's messages are void from now on
        self._forget_acks()
        while self.receipts.in_flight:
            batch = self.receipts.take(timeout_s=60.0)
            if batch is None:
                break
            self.receipted(batch)
        self.take_unstarted()  # the broker has them again
        for delivery in self.running:
            if not delivery.acked:
                delivery.acked = True  # its run goes on, holding a slot without a message
                delivery.lane.acked_running += 1

    # -- handing batches to the receipt stage --------------------------------------------------

    def dispatch(self) -> None:
        """Plan what arrived, and send planned batches to the receipt stage while a writer
        is free (at most ``batch_size`` starts a batch, so the first runs of a large
        intake start after a small write, and the writers share the rest)."""
        if not self.receipts.full and (self.pending or any(lane.backlog and lane.free()
                                                           for lane in self.lanes)):
            if self.global_qos:
                for delivery in self.pending:
                    self._arrived[delivery.lane].append(delivery)
            start, release, dupes = plan(self.lanes, self.pending)  # plan keeps no reference
            self.pending.clear()
            for k in range(0, max(1, len(start)), self._batch_size):
                first = k == 0
                self._planned.append(Batch(start[k:k + self._batch_size],
                                           release if first else [], dupes if first else []))
        while self._planned and not self.receipts.full:
            batch = self._planned.popleft()
            if batch.start or batch.release or batch.dupes:
                self.receipts.send(batch)

    def receipted(self, batch: Batch) -> None:
        """A batch's RUNNING move committed: ack what will not run, start the rest."""
        for delivery in batch.start:
            delivery.lane.reserved -= 1
        if batch.started is None:
            return  # given up while stopping: unacked, the broker gets them back
        started = batch.started
        refused = [d for d in batch.start if d.task.task_id not in started]
        for delivery in batch.release + batch.dupes + refused:
            self.ack(delivery)
        account(batch, refused, self._stats)
        running = [d for d in batch.start if d.task.task_id in started]
        for delivery in running:  # from here on the task is the row, not the message
            delivery.task = started[delivery.task.task_id]
            delivery.fenced_by = batch.incarnation
        self._ack_long(running)
        self._submit(running)

    def take_unstarted(self) -> list[Delivery]:
        """Remove and return what was received and not fenced: pending, backlogs, and
        planned batches not sent to a writer (their reservations are dropped)."""
        unstarted = self.pending + [d for lane in self.lanes for d in lane.backlog]
        while self._planned:
            batch = self._planned.popleft()
            for delivery in batch.start:
                delivery.lane.reserved -= 1
            unstarted += batch.start + batch.release + batch.dupes
        self.pending.clear()
        for lane in self.lanes:
            lane.backlog.clear()
        return unstarted

    # -- running -------------------------------------------------------------------------------

    def _ack_long(self, running: list[Delivery]) -> None:
        """Ack at start the messages of tasks allowed over ACK_AT_START_MS (lanes.py)."""
        long_runs = [d for d in running if d.task.timeout_ms > ACK_AT_START_MS]
        for delivery in long_runs:
            delivery.lane.acked_running += 1
        for lane in {d.lane for d in long_runs}:
            lane.apply(self.global_qos)  # the prefetch shrinks before the acks land
        for delivery in long_runs:
            self.ack(delivery)

    def _submit(self, running: list[Delivery]) -> None:
        """Hand fenced runs to their pools: a free thread, or the stage (see lanes.py); one
        lock per pool for the whole batch."""
        by_pool: dict[Pool, list[Delivery]] = {}
        for delivery in running:
            delivery.cancel = Cancellation()
            by_pool.setdefault(delivery.lane.pool, []).append(delivery)
        with self._staged_lock:
            self._staged.update(running)
        self.running.update(running)
        if running:
            self.latest_trigger = max(self.latest_trigger,
                                      max(d.task.trigger_time for d in running))
        now = time.monotonic()
        for pool, deliveries in by_pool.items():
            jobs = []
            for delivery in deliveries:
                # a run received before its trigger time waits in the stage, not in a thread
                hold_s = self._hold_s(delivery.task)
                jobs.append(Submission(partial(self._start, delivery),
                                       partial(self._done, delivery),
                                       partial(self._timeout_s, delivery.task), delivery.labels,
                                       delivery.cancel, now + hold_s if hold_s else 0.0))
            if not pool.submit_reserved(jobs):  # its room was reserved by plan(); stopping
                for delivery in deliveries:
                    self._done(delivery, Outcome(False, abandoned="the pool is closed"))

    def _hold_s(self, task: TaskMessage) -> float:
        """How long until the task's trigger time (0 once due), on the database clock."""
        return max(0.0, task.trigger_time - self._clock()) / 1000.0

    def _timeout_s(self, task: TaskMessage) -> float:
        """A run's timeout from when a thread takes it: what is left of the hold until its
        trigger time, then ``timeout_ms``."""
        return self._hold_s(task) + task.timeout_ms / 1000.0

    def _start(self, delivery: Delivery) -> Any:
        """A pool thread takes a staged run: hold it until its trigger time, make sure the
        incarnation that fenced it is still certainly live (:class:`~ax_kombu.core.lease.Lease`:
        a run fenced before the worker was declared dead never starts, even when its batch
        came back after the stage was withdrawn), then run it — unless it was cancelled or
        withdrawn meanwhile (the processor is then
        not called, and no outcome is recorded: the row is no longer RUNNING at this
        attempt, or is handed back by whoever withdrew it)."""
        task, cancel = delivery.task, delivery.cancel
        assert cancel is not None
        while (left_ms := task.trigger_time - self._clock()) > 0 and not cancel.wait(
                left_ms / 1000.0):
            pass
        while (covered := self._lease.covers(delivery.fenced_by)) is None and not cancel:
            self._lease.wait(delivery.fenced_by, LEASE_WAIT_S)
        with self._staged_lock:
            withdrawn = delivery not in self._staged or covered is False
            held = delivery.held and not withdrawn and not cancel
            if not held:
                self._staged.discard(delivery)
        if held:  # written down as held: released (committed) first
            assert self._holds is not None
            released = self._holds.release(task.task_id, delivery.fenced_by,
                                           lambda: bool(cancel) or delivery not in self._staged)
            with self._staged_lock:
                withdrawn = not released or delivery not in self._staged
                self._staged.discard(delivery)
                if released:
                    delivery.held = False
        if withdrawn or cancel:
            raise Withdrawn(f"{cancel.reason or 'withdrawn'} before it started")
        delivery.started = True
        metrics.start_delay.observe(-left_ms / 1000.0)
        # the real start (the RUNNING move wrote when it was fenced): the result records it
        task = delivery.task = task.started(max(task.trigger_time, int(self._now_ms())))
        ctx = Context(task.task_id, task.attempt, task.trace_id, task.trigger_time,
                      task.task_type, task.retry_count, task.max_retry, task.timeout_ms,
                      cancel, time.monotonic() + task.timeout_ms / 1000.0, task.job,
                      task.scheduled_at, task.shard_index, task.shard_total)
        began = time.monotonic()
        try:
            return self._execute(task, ctx)
        finally:
            delivery.lane.timed(time.monotonic() - began)

    def holdable(self) -> list[int]:
        """Flag held the staged runs their lane's threads will not reach within
        HOLD_AFTER_S (after its free threads, at its measured run time, earliest trigger
        first), telling :class:`~ax_kombu.worker.holds.Holds` under the same lock as
        :meth:`_start` takes them; return the held runs now within reach, to release early.
        Called every :data:`~ax_kombu.worker.holds.SCAN_S` by the holds' thread."""
        holds = self._holds
        assert holds is not None
        reach = {lane: lane.pool.free + lane.can_finish(HOLD_AFTER_S) for lane in self.lanes
                 # a lane whose run time is not measured yet holds only behind runs that
                 # have already taken longer than the horizon
                 if lane.measured or lane.pool.running_for_s() > HOLD_AFTER_S}
        crowded = {lane for lane in reach if lane.pool.staged > reach[lane]}
        soon: list[int] = []
        if not crowded and not holds.holding:
            return soon
        with self._staged_lock:
            by_lane: dict[Lane, list[Delivery]] = {}
            for delivery in self._staged:
                if delivery.lane in crowded:
                    by_lane.setdefault(delivery.lane, []).append(delivery)
                elif delivery.held:
                    soon.append(delivery.task.task_id)
            hold: list[tuple[int, int]] = []
            for lane, staged in by_lane.items():
                staged.sort(key=lambda d: d.task.trigger_time)
                soon += [d.task.task_id for d in staged[:reach[lane]] if d.held]
                for delivery in staged[reach[lane]:]:
                    if not delivery.held:
                        delivery.held = True
                        hold.append((delivery.task.task_id, delivery.fenced_by))
            if hold:
                holds.hold(hold)
        return soon

    def withdraw_staged(self) -> list[Delivery]:
        """Take back the runs not started yet (staged, or held before their trigger time):
        none of them will call its processor, and none records an outcome. Whoever
        withdraws them writes their rows back; their pool threads end at :meth:`wake`."""
        with self._staged_lock:
            staged, self._staged = list(self._staged), set()
        return staged

    @staticmethod
    def wake(withdrawn: list[Delivery], reason: str = "shutdown") -> None:
        """Signal runs to end (withdrawn ones end without starting), now: a staged run
        waiting for its trigger time leaves its pool's stage at once."""
        for delivery in withdrawn:
            if delivery.cancel is not None:
                delivery.cancel.set(reason)
        for lane in {d.lane for d in withdrawn}:
            lane.pool.release_cancelled()

    def _execute(self, task: TaskMessage, ctx: Context) -> Any:
        if type(task.payload) is UnreadablePayload:
            raise ProcessorRefused("the stored payload is not JSON")
        func = self._resolver.resolve(task.processor, task.callback_url)
        return call(func, task.payload, ctx)

    def _done(self, delivery: Delivery, outcome: Outcome) -> None:
        """A run's outcome (pool thread): to the result writer; its message is acked (and
        its room in the lane's prefetch freed) once the outcome is durable. A run that
        never started (withdrawn, cancelled, or abandoned while staged) records nothing
        and is settled at once."""
        if delivery.started:
            self._results.put(delivery.task, outcome, on_durable=partial(self._ended, delivery))
            return
        if delivery.held and self._holds is not None:
            delivery.held = False
            self._holds.forget([delivery.task.task_id])
        if delivery.cancel is not None and delivery.cancel.reason == "timeout":
            self.expired_holds.put(delivery)  # nobody else writes its row back
        self._ended(delivery)

    def _ended(self, delivery: Delivery) -> None:
        """The run is over and its outcome, if any, durable: settle it (any thread)."""
        self._completed.put(delivery)
        self._wakeup.poke()

    def take_expired_holds(self) -> list[Delivery]:
        """Remove and return the runs whose timeout passed while held (see
        :attr:`expired_holds`), for the node to hand back."""
        return _drain(self.expired_holds)

    # -- settling ------------------------------------------------------------------------------

    def settle(self) -> None:
        """Start written batches; ack ended runs; bring every lane's prefetch up to date."""
        while (batch := self.receipts.take()) is not None:
            self.receipted(batch)
        ended = _drain(self._completed)
        for delivery in ended:
            self.running.discard(delivery)
            if delivery.acked:
                delivery.lane.acked_running -= 1
        if not self._flags.stopping:
            for lane in self.lanes:  # before the acks: a stuck slot lowers the prefetch
                lane.apply(self.global_qos)
        for delivery in ended:
            self.ack(delivery)
        self.flush_acks()

    def ack(self, delivery: Delivery) -> None:
        """Ack a delivery's message once, if it came on the current connection (on
        RabbitMQ at the next :meth:`flush_acks`, which whoever acks calls before it waits)."""
        if delivery.acked or delivery.generation != self.generation:
            return
        delivery.acked = True
        delivery.lane.held -= 1
        if self.global_qos:
            self._acks.setdefault(delivery.lane, []).append(delivery)
            return
        delivery.message.ack()
        if self._puller is not None:
            self._released[self.lanes.index(delivery.lane)] += 1

    def flush_acks(self) -> None:
        """RabbitMQ: send the acks :meth:`ack` collected, in as few frames as is safe.

        A lane's deliveries share one channel, whose delivery tags grow in arrival order.
        Every tag below the lane's oldest delivery still unacked is settled (acked or
        rejected), so the acks below it go as ONE ``basic.ack`` with ``multiple`` (up to the
        highest of them); an ack above it (a run still going holds an older message) goes
        on its own. Nothing is kept for a later loop, so a connection that closes after
        this loses no ack."""
        for lane, acks in self._acks.items():
            arrived = self._arrived[lane]
            while arrived and arrived[0].acked:
                arrived.popleft()
            oldest = [d.message.delivery_tag for d in (arrived[0] if arrived else None,
                                                       self._first_pending(lane)) if d]
            below = min(oldest) if oldest else None
            top: Delivery | None = None
            for delivery in acks:
                tag = delivery.message.delivery_tag
                if below is not None and tag > below:
                    delivery.message.ack()
                elif top is None or tag > top.message.delivery_tag:
                    top = delivery
            if top is not None:
                top.message.ack(multiple=True)
        self._acks.clear()

    def _first_pending(self, lane: Lane) -> Delivery | None:
        """The lane's first delivery received and not planned yet (not in _arrived yet)."""
        return next((d for d in self.pending if d.lane is lane and not d.acked), None)

    def _forget_acks(self) -> None:
        """A new connection: acks collected for the old one are void, tags start again."""
        self._acks.clear()
        for arrived in self._arrived.values():
            arrived.clear()

    def give_room(self) -> None:
        """Tell the puller, once per loop, how much room the acks since the last call freed."""
        if self._puller is not None:
            for index, n in enumerate(self._released):
                if n:
                    self._puller.release(index, n)
        self._released = [0] * len(self.lanes)


def _drain(deliveries: queue.SimpleQueue[Delivery]) -> list[Delivery]:
    """Everything in ``deliveries`` now, taken out, without waiting."""
    taken: list[Delivery] = []
    while True:
        try:
            taken.append(deliveries.get_nowait())
        except queue.Empty:
            return taken
