"""Planning: received runs → receipt batches → fenced runs, on the consuming thread.

The consumer (:mod:`ax_kombu.worker.consumer`) appends what it receives to
:attr:`Planner.pending` (RECEIVED); once per loop :meth:`Planner.dispatch` plans it:

1. each run is planned into its lane's executor — a free thread, or the lane's *stage*
   (runs fenced ahead of a free thread, bounded: see :mod:`ax_kombu.worker.lanes`):
   PLANNED, its room reserved; what cannot be taken waits in the lane's backlog (only
   with ``prefetch_multiplier`` > 1), else is handed back (:func:`plan`);
2. the receipt stage (:mod:`ax_kombu.worker.receipts`, its own threads) moves the PLANNED
   tasks DISPATCHING → RUNNING in ONE statement, only where the row's attempt equals the
   message's (the fencing token) and the worker's incarnation is the live one, and
   returns each started row: what runs is the row, not the message's copy; the handed-back
   ones go DISPATCHING → READY. Meanwhile the consuming thread keeps draining, so the next
   batch is what arrived during this one's round trip (at most ``worker_batch_size``);
3. :meth:`Planner.receipted`: a run whose move failed (task cancelled, or a stale message
   from an earlier attempt) is REFUSED: logged with the reason, counted, acked, not run;
   handed-back runs and duplicates are acked; the FENCED runs go to the
   :class:`~ax_kombu.worker.starts.Starter`.

A message is acked only after its RUNNING move committed, and normally stays unacked while
its run waits or runs: the broker's prefetch (the lane's window: threads and stage) then
bounds exactly what a lane keeps, so a worker is only handed work it can start soon and
nothing waits in an unbounded queue. A task allowed over :data:`~ax_kombu.worker.lanes.ACK_AT_START_MS`
has its message acked when it is fenced, its slot counted in ``acked_running``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from ax_kombu.worker.acks import Acks
from ax_kombu.worker.counters import Counters
from ax_kombu.worker.lanes import ACK_AT_START_MS, Lane
from ax_kombu.worker.receipts import Batch, ReceiptWriter, account
from ax_kombu.worker.run import Run, State
from ax_kombu.worker.starts import Starter


def plan(lanes: Sequence[Lane], fresh: list[Run[Lane]]
         ) -> tuple[list[Run[Lane]], list[Run[Lane]], list[Run[Lane]]]:
    """Split the lanes' backlogs and ``fresh`` runs into (start, release, dupes).

    * dupes: every run of a task but the one with the newest attempt (only that one can
      still be live);
    * start: as many as each lane's executor can take, running or staged
      (:meth:`Lane.free`), oldest first: PLANNED, reserved until their batch is written;
    * the rest wait in the lane's backlog (up to :meth:`Lane.backlog_max`), and what does
      not fit there is released, to go back to READY.
    """
    newest: dict[int, Run[Lane]] = {}
    dupes: list[Run[Lane]] = []
    for r in [r for lane in lanes for r in lane.backlog] + fresh:
        kept = newest.get(r.task.task_id)
        if kept is None:
            newest[r.task.task_id] = r
        elif r.task.attempt > kept.task.attempt:
            dupes.append(kept)
            newest[r.task.task_id] = r
        else:
            dupes.append(r)
    start: list[Run[Lane]] = []
    release: list[Run[Lane]] = []
    for lane in lanes:
        queued = [r for r in newest.values() if r.lane is lane]
        lane.backlog.clear()
        free = lane.free()
        start.extend(queued[:free])
        lane.reserved += len(queued[:free])
        for r in queued[free:]:
            (lane.backlog if len(lane.backlog) < lane.backlog_max() else release).append(r)
    for r in start:
        r.move(State.PLANNED)
    return start, release, dupes


class Planner:
    """Plans received runs into receipt batches and takes the written batches back.

    Args:
        receipts: the receipt stage the batches go to.
        starter: where the fenced runs go.
        batch_size: the most RUNNING moves one receipt batch makes.
    """

    def __init__(self, lanes: Sequence[Lane], *, receipts: ReceiptWriter, acks: Acks,
                 starter: Starter, stats: Counters, pending: list[Run[Lane]],
                 batch_size: int = 500) -> None:
        self._lanes = lanes
        self.receipts = receipts
        self._acks = acks
        self._starter = starter
        self._stats = stats
        #: received and not planned yet; the consumer appends, this list object stays the same
        self.pending = pending
        #: planned batches (their room reserved) waiting for a free receipt writer
        self._planned: deque[Batch] = deque()
        self._batch_size = batch_size

    def dispatch(self) -> None:
        """Plan what arrived, and send planned batches to the receipt stage while a writer
        is free (at most ``batch_size`` starts a batch, so the first runs of a large
        intake start after a small write, and the writers share the rest)."""
        if not self.receipts.full and (self.pending or any(lane.backlog and lane.free()
                                                           for lane in self._lanes)):
            self._acks.arrived(self.pending)
            start, release, dupes = plan(self._lanes, self.pending)  # plan keeps no reference
            self.pending.clear()
            for k in range(0, max(1, len(start)), self._batch_size):
                first = k == 0
                self._planned.append(Batch(start=start[k:k + self._batch_size],
                                           release=release if first else [],
                                           dupes=dupes if first else []))
        while self._planned and not self.receipts.full:
            batch = self._planned.popleft()
            if batch.start or batch.release or batch.dupes:
                self.receipts.send(batch)

    def receipted(self, batch: Batch) -> None:
        """A batch's moves committed: settle what will not run, hand the FENCED runs on."""
        for run in batch.start:
            run.lane.reserved -= 1
        if batch.started is None:  # given up while stopping: unacked, the broker has them
            for run in batch.start + batch.release + batch.dupes:
                run.move(State.RETURNED)
            return
        started = batch.started
        refused = [r for r in batch.start if r.task.task_id not in started]
        fenced = [r for r in batch.start if r.task.task_id in started]
        self._settle(batch.release, State.HANDED_BACK)
        self._settle(batch.dupes + refused, State.REFUSED)
        account(batch, refused, self._stats)
        for run in fenced:  # from here on the task is the row, not the message
            run.task = started[run.task.task_id]
            run.incarnation = batch.incarnation
            run.move(State.FENCED)
        self._ack_long(fenced)
        self._starter.submit(fenced)

    def _settle(self, runs: list[Run[Lane]], end: State) -> None:
        """``runs`` end here without running (``end``): settled, their messages acked."""
        for run in runs:
            run.move(end)
            run.move(State.SETTLED)
            self._acks.ack(run)

    def _ack_long(self, fenced: list[Run[Lane]]) -> None:
        """Ack at start the messages of tasks allowed over ACK_AT_START_MS (lanes.py)."""
        long_runs = [r for r in fenced if r.task.timeout_ms > ACK_AT_START_MS]
        for run in long_runs:
            run.lane.acked_running += 1
        for lane in {r.lane for r in long_runs}:
            lane.apply(self._acks.global_qos)  # the prefetch shrinks before the acks land
        for run in long_runs:
            self._acks.ack(run)

    def take_unstarted(self) -> list[Run[Lane]]:
        """Remove and return what was received and not fenced: pending, backlogs, and
        planned batches not sent to a writer (their reservations are dropped). The caller
        moves them on (handed back, or returned to the broker)."""
        unstarted = self.pending + [r for lane in self._lanes for r in lane.backlog]
        while self._planned:
            batch = self._planned.popleft()
            for run in batch.start:
                run.lane.reserved -= 1
            unstarted += batch.start + batch.release + batch.dupes
        self.pending.clear()
        for lane in self._lanes:
            lane.backlog.clear()
        return unstarted
