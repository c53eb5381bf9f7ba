"""The receipt stage: received messages become RUNNING tasks, one statement per batch.

The worker's consuming thread plans a batch (which messages start, which go
back, which are duplicates) and hands it here; one thread then moves the
startable tasks DISPATCHING → RUNNING with :func:`ax_kombu.store.transitions.start_many`
(fenced by attempt, ``started_at`` and ``owner_node`` set), the others
DISPATCHING → READY with :func:`~ax_kombu.store.transitions.release_many`, in one
transaction, and finds out why any move was refused. The RUNNING move returns
what each started row stores, and that is what runs: a message only says
"task X, attempt N is due" (its attempt is the fencing token); its other
fields are compared with the row, and a message that differs (forged, or
tampered with on the broker) is logged and counted, and the stored task runs.
The consuming thread
keeps draining the broker meanwhile, so the next batch is whatever arrived
during the round trip: batches grow with load (like a group commit) and a
lone message waits for nobody. A few batches are in flight at once, each on
its own thread and connection (``worker_receipt_writers``), so a batch never
waits for the one before it to commit; nothing is acked before its batch has
committed. Two batches in flight may carry a message for the same task (a
redelivery): the row lock decides, one moves and the other is refused.
"""

from __future__ import annotations

import json
import logging
import operator
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, select
from sqlalchemy.exc import SQLAlchemyError

from ax_kombu.broker.messages import WIRE_FIELDS, TaskMessage
from ax_kombu.core.states import Status
from ax_kombu.observability import metrics
from ax_kombu.store import Store, transitions
from ax_kombu.store.pinned import PinnedConnection
from ax_kombu.store.schema import tasks
from ax_kombu.worker.counters import Counters
from ax_kombu.worker.lanes import Lane
from ax_kombu.worker.run import Run
from ax_kombu.worker.task import RunTask

log = logging.getLogger(__name__)

_wire = operator.attrgetter(*WIRE_FIELDS)
#: what a version-2 message says that its row says too (task_id and attempt fence the move)
_SLIM_COMPARED = ("trace_id", "trigger_time", "priority")
_slim_compared = operator.attrgetter(*_SLIM_COMPARED)


@dataclass(eq=False, kw_only=True)
class Batch:
    """One round of receipts, and (once written) what came of it."""

    start: list[Run[Lane]]
    release: list[Run[Lane]]
    dupes: list[Run[Lane]]
    #: task id → the task now RUNNING as its row stores it (what runs);
    #: None if the write was given up (the messages stay unacked)
    started: dict[int, RunTask] | None = None
    #: started deliveries whose message differs from the stored task, with the fields that do
    forged: list[tuple[Run[Lane], list[str]]] = field(default_factory=list)
    #: task id → (counter suffix, log text) for each refused start
    refusals: dict[int, tuple[str, str]] = field(default_factory=dict)
    #: the worker incarnation the RUNNING moves were fenced under
    incarnation: int = 0


class ReceiptWriter:
    """``writers`` threads, each writing one :class:`Batch` at a time for the consuming thread.

    :attr:`in_flight` and :attr:`full` are for the consuming thread only.

    Args:
        on_done: called (from a writer thread) when a batch is written.
        give_up: while the database is down, True means stop retrying.
        writers: how many batches may be in flight at once.
    """

    def __init__(self, store: Store, node_id: str, on_done: Callable[[], None],
                 give_up: Callable[[], bool], writers: int = 2,
                 incarnation: Callable[[], int] | None = None) -> None:
        self.store = store
        self.node_id = node_id
        self._incarnation = incarnation
        self._on_done = on_done
        self._give_up = give_up
        self._inbox: queue.SimpleQueue[Batch | None] = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue[Batch] = queue.SimpleQueue()
        #: batches sent and not taken back yet
        self.in_flight = 0
        self._threads = [threading.Thread(target=self._run, name=f"ax-receipts-{i}", daemon=True)
                         for i in range(max(1, writers))]
        for thread in self._threads:
            thread.start()

    @property
    def full(self) -> bool:
        """True when every writer has a batch (:meth:`send` must wait)."""
        return self.in_flight >= len(self._threads)

    def send(self, batch: Batch) -> None:
        """Start writing ``batch`` (only when not :attr:`full`)."""
        if self.full:
            raise RuntimeError("every receipt writer is busy")
        self.in_flight += 1
        self._inbox.put(batch)

    def take(self, timeout_s: float | None = None) -> Batch | None:
        """A written batch, if one is done (waiting up to ``timeout_s``)."""
        if not self.in_flight:
            return None
        try:
            batch = self._outbox.get(timeout=timeout_s) if timeout_s else self._outbox.get_nowait()
        except queue.Empty:
            return None
        self.in_flight -= 1
        return batch

    def close(self) -> None:
        for _ in self._threads:
            self._inbox.put(None)
        for thread in self._threads:
            thread.join(5.0)

    def _run(self) -> None:
        db = PinnedConnection(self.store.engine, autocommit=True)  # see _write
        try:
            while (batch := self._inbox.get()) is not None:
                try:
                    self._write(db, batch)
                finally:
                    self._outbox.put(batch)
                    self._on_done()
        finally:
            db.close()

    def _write(self, db: PinnedConnection, batch: Batch) -> None:
        """Record a batch; retried while the database is down.

        On PostgreSQL each statement commits by itself (one round trip): the
        RUNNING moves, the READY moves and the read explaining refusals touch
        rows independently, each statement is atomic, and nothing is acked or
        started before the statements returned. The RUNNING move is fenced by
        this worker's live incarnation (a worker declared dead starts nothing).
        If the connection breaks after a RUNNING move committed but before its
        answer arrived, the retry repeats it with the same start time as a
        *resume*: the rows it did move count as started by this worker, so none
        is left RUNNING without running.
        """
        pause = 0.05
        now: int | None = None  # one start time for every try: a resume looks for it
        resume = False
        while True:
            try:
                if now is None:
                    now = self.store.now_ms()
                self._write_once(db, batch, now, resume)
                return
            except SQLAlchemyError:
                log.warning("could not record received tasks; retrying", exc_info=True,
                            extra={"count": len(batch.start) + len(batch.release)})
                if self._give_up():
                    return
                resume = now is not None
                time.sleep(pause)
                pause = min(pause * 2, 2.0)

    def _write_once(self, db: PinnedConnection, batch: Batch, now: int, resume: bool) -> None:
        incarnation = self._incarnation() if self._incarnation is not None else None
        batch.incarnation = incarnation or 0
        with db.begin() as conn:
            rows = transitions.start_many(
                conn, [d.pair for d in batch.start], self.node_id, now,
                incarnation=incarnation, resume=resume)
            transitions.release_many(conn, [d.pair for d in batch.release])
            moved = {row.task_id for row in rows}
            refused = [d for d in batch.start if d.task.task_id not in moved]
            batch.refusals = _explain(conn, refused)
        batch.started, batch.forged = stored_tasks(batch.start, rows)


class UnreadablePayload(str):
    """A stored payload that is not JSON (the row was written by hand): its run fails."""


def stored_tasks(runs: list[Run[Lane]], rows: list[transitions.Started]
                 ) -> tuple[dict[int, RunTask], list[tuple[Run[Lane], list[str]]]]:
    """The started tasks as their rows store them, and the messages that differ from those.

    Each stored payload is parsed here, once. The message keeps only what
    decides nothing: its attempt (equal to the row's: the start was fenced by
    it), ``dispatched_at`` and ``node``. A message that differs anywhere else is
    returned with the names of the fields that do (never their values).
    """
    by_id = {r.task.task_id: r for r in runs}
    started: dict[int, RunTask] = {}
    forged: list[tuple[Run[Lane], list[str]]] = []
    for row in rows:
        run = by_id[row.task_id]
        message = run.task
        assert type(message) is TaskMessage  # not fenced yet: the message's
        try:
            payload: Any = json.loads(row.payload)
        except (ValueError, RecursionError):  # written by hand: the run fails, saying so
            payload = UnreadablePayload(row.payload)
        task = RunTask.of(row, message, payload)
        started[row.task_id] = task
        compared = _slim_compared if message.slim else _wire  # version 2: the few it carries
        if compared(task) != compared(message):
            names = _SLIM_COMPARED if message.slim else WIRE_FIELDS
            forged.append((run, [name for name in names
                                 if getattr(task, name) != getattr(message, name)]))
    return started, forged


def account(batch: Batch, refused: list[Run[Lane]], stats: Counters) -> None:
    """Count and log what a written batch did not start (handed back, duplicate, refused)."""
    stats.add("received", len(batch.start) + len(batch.release) + len(batch.dupes))
    stats.add("started", len(batch.start) - len(refused))
    for delivery in batch.release:
        stats.add("handed_back")
        log.info("pool full: task handed back to the scheduler as READY",
                 extra={**delivery.labels, "queue": delivery.lane.queue.name})
    metrics.stale_messages_total.inc(len(batch.dupes) + len(refused))
    if batch.forged:
        stats.add("forged", len(batch.forged))
        metrics.rejected_messages_total.labels(reason="forged").inc(len(batch.forged))
    for delivery, fields in batch.forged:
        log.warning("message differs from the stored task: the stored task runs",
                    extra={**delivery.labels, "reason": "message differs from the stored task",
                           "fields": fields})
    for delivery in batch.dupes:
        stats.add("refused_duplicate")
        log.info("duplicate delivery dropped", extra=delivery.labels)
    for delivery in refused:
        reason, why = batch.refusals.get(delivery.task.task_id, ("unknown", "unknown"))
        stats.add(f"refused_{reason}")
        if reason == "missing":  # well-formed, for no task at all (see broker/rejects.py)
            metrics.rejected_messages_total.labels(reason="unknown_task").inc()
        log.info("message refused, not run", extra={**delivery.labels, "reason": why})


def _explain(conn: Connection, refused: list[Run[Lane]]) -> dict[int, tuple[str, str]]:
    """Why each RUNNING move failed (one read for the batch)."""
    if not refused:
        return {}
    rows = {r.task_id: r for r in conn.execute(
        select(tasks.c.task_id, tasks.c.status, tasks.c.attempt)
        .where(tasks.c.task_id.in_([d.task.task_id for d in refused])))}
    return {d.task.task_id: refusal(d.task, rows.get(d.task.task_id)) for d in refused}


def refusal(task: TaskMessage | RunTask, row: Any) -> tuple[str, str]:
    """(counter suffix, log text) for a message whose RUNNING move failed."""
    if row is None:
        return "missing", "no such task"
    if row.attempt != task.attempt:
        return "stale", f"stale message: attempt {task.attempt}, the task is at {row.attempt}"
    if row.status == Status.CANCELLED:
        return "cancelled", "the task was cancelled"
    if row.status == Status.DISPATCHING:  # the row was right: the worker's fence refused it
        return "fenced", ("this worker's incarnation is no longer the live one (declared "
                          "dead); the task is sent again after its ack timeout")
    return "state", f"the task is {row.status}, not DISPATCHING"
