"""The intake: received messages → receipt batches → runs → acks, on the consuming thread.

Each received message is a :class:`~ax_kombu.worker.run.Run` with one state, moved only
through :meth:`~ax_kombu.worker.run.Run.move`. The intake is three parts, one subject each:

* :class:`~ax_kombu.worker.planning.Planner` — planning and receipt batches: RECEIVED →
  PLANNED → FENCED (or handed back, refused);
* :class:`~ax_kombu.worker.starts.Starter` — the start protocol: STAGED (or LISTED) →
  STARTED → ENDED → DURABLE, on the executors' threads (trigger wait, lease, release of a
  listed run);
* :class:`~ax_kombu.worker.acks.Acks` — acks: each message once, on its connection, in
  as few frames as is safe, and the puller's credit.

:class:`Intake` puts them together and settles what came back once per loop
(:meth:`Intake.settle`): written batches start, ended runs are SETTLED (their messages
acked, their room in the lane's prefetch freed).

**A worker killed** while runs wait in the stage leaves them RUNNING on a dead node, and
the recovery gives them another attempt (they never ran, so nothing ran twice); those
listed (:mod:`ax_kombu.worker.listing`) get it without a retry counted. ``ax cancel``
stops a waiting run before it starts; a stopping worker (warm or cold) withdraws the runs
that have not started (:meth:`Intake.withdraw`) and hands them back, and so does a quiet
one (:mod:`~ax_kombu.worker.quiet`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ax_kombu.broker import redis_pull
from ax_kombu.core.lease import Lease
from ax_kombu.worker.acks import Acks
from ax_kombu.worker.control import StopFlags, Wakeup
from ax_kombu.worker.counters import Counters
from ax_kombu.worker.executor import Executor
from ax_kombu.worker.lanes import Lane
from ax_kombu.worker.listing import Listing
from ax_kombu.worker.planning import Planner
from ax_kombu.worker.processors import Resolver
from ax_kombu.worker.receipts import ReceiptWriter
from ax_kombu.worker.run import Run, State
from ax_kombu.worker.scopes import RunScope
from ax_kombu.worker.stage import Stage
from ax_kombu.worker.starts import Outcomes, Starter


class Intake:
    """Plans received runs, starts the fenced ones, acks what has ended.

    Args:
        lanes: the lanes consumed, in the order the consumer and puller number them.
        receipts: the receipt stage the batches go to.
        results: where each run's outcome goes.
        resolver: how a task's processor name resolves to a function.
        wakeup: rung when a run ends.
        flags: while stopping, lanes' prefetch is left as it is (consumers stay cancelled).
        clock: the earliest the database time can be, epoch ms, without a round trip
            (:meth:`~ax_kombu.store.clock.DbClock.earliest_ms`): a staged run waits until
            its task's trigger time.
        lease: a staged run starts only while the worker's incarnation is certainly live.
        batch_size: the most RUNNING moves one receipt batch makes.
        now_ms: the database time a run's start is recorded at (default ``clock``).
        listing: where the runs a lane will not reach soon are listed (None: none are,
            and a dead worker's RUNNING tasks all count as started).
        stage: the index of runs in the executors (default a new one).
    """

    def __init__(self, lanes: list[Lane], *, receipts: ReceiptWriter, results: Outcomes,
                 resolver: Resolver, stats: Counters, wakeup: Wakeup, flags: StopFlags,
                 clock: Callable[[], float], lease: Lease, batch_size: int = 500,
                 now_ms: Callable[[], float] | None = None, listing: Listing | None = None,
                 stage: Stage | None = None, scopes: Sequence[RunScope] = ()) -> None:
        self.lanes = lanes
        self._flags = flags
        #: the worker is quiet (:mod:`~ax_kombu.worker.quiet`): lanes' prefetch is left as it
        #: is (consumers stay cancelled, the puller without room)
        self.quiet = False
        self.stage = stage or Stage()
        #: received and not planned yet; the consumer appends, this list object stays the same
        self.pending: list[Run[Lane]] = []
        self.acks = Acks(lanes, self.pending)
        executors: dict[Lane, Executor] = {lane: lane.pool for lane in lanes}
        self.starter = Starter(stage=self.stage, executors=executors, results=results,
                               resolver=resolver, wakeup=wakeup, clock=clock,
                               now_ms=now_ms or clock, lease=lease, listing=listing,
                               scopes=scopes)
        self.planner = Planner(lanes, receipts=receipts, acks=self.acks, starter=self.starter,
                               stats=stats, pending=self.pending, batch_size=batch_size)
        self.receipts = receipts

    # -- the connection ------------------------------------------------------------------------

    def connected(self, global_qos: bool, puller: redis_pull.Puller | None) -> int:
        """A new broker connection: returns its generation (:meth:`Acks.connected`)."""
        return self.acks.connected(global_qos, puller)

    def connection_lost(self) -> None:
        """After a lost connection: unacked messages are the broker's again."""
        self.acks.lost()
        while self.receipts.in_flight:
            batch = self.receipts.take(timeout_s=60.0)
            if batch is None:
                break
            self.planner.receipted(batch)
        for run in self.planner.take_unstarted():  # the broker has them again
            run.move(State.RETURNED)
        for run in list(self.stage.runs):
            if not run.acked:
                run.message = None  # its run goes on, keeping a slot without a message
                run.lane.acked_running += 1

    # -- the loop ------------------------------------------------------------------------------

    def settle(self) -> None:
        """Start written batches; settle ended runs; bring every lane's prefetch up to date."""
        while (batch := self.receipts.take()) is not None:
            self.planner.receipted(batch)
        ended = self.starter.take_completed()
        self.stage.discard(ended)
        for run in ended:
            if run.acked:
                run.lane.acked_running -= 1
        if not (self._flags.stopping or self.quiet):
            for lane in self.lanes:  # before the acks: a stuck slot lowers the prefetch
                lane.apply(self.acks.global_qos)
        for run in ended:
            run.move(State.SETTLED)
            self.acks.ack(run)
        self.acks.flush()

    def withdraw(self) -> list[Run[Lane]]:
        """Take back the runs not started yet (:meth:`Stage.withdraw`): the caller writes
        their rows back, then ends their waits (:meth:`Starter.wake`)."""
        return self.stage.withdraw()
