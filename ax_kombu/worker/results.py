"""The batched result writer: run outcomes become SUCCESS, FAILED or DELAYED rows.

Pool threads hand every outcome to :meth:`ResultWriter.put` (a queue append
that waits only when the bound below is reached). One writer thread turns them into state changes and writes
them with :func:`ax_kombu.store.transitions.finish_many` — one statement per batch of at
most ``worker_batch_size`` results, at least every ``worker_batch_ms`` —
instead of one transaction per task.

Decisions, for a run of attempt *a* of a task:

* success → SUCCESS, ``finished_at``;
* failure, timeout, or abandoned at shutdown, with ``retry_count <
  max_retry`` → DELAYED with ``trigger_time = now + backoff(retry_count)``,
  ``retry_count + 1``, ``last_error``, ``owner_node = NULL`` (a scheduler
  claims it like any delayed task);
* otherwise, or a processor refused as not allowed (retrying cannot help)
  → FAILED with ``finished_at`` and ``last_error``;
* what the processor said its failure means (``ax.Retry``, ``ax.Snooze``,
  ``ax.Discard``, its registration's ``retry_on`` and ``backoff``) comes first:
  :func:`~ax_kombu.worker.outcomes.decide` has the rules, this writer looks the
  registered policy up by the task's processor name.

Every write is fenced by attempt and status RUNNING: a task cancelled or
recovered by a scheduler meanwhile is left alone (counted as ``stale``).

The same transaction stores the lines each run logged (:mod:`ax_kombu.worker.runlog`,
one statement for the batch), a success's return value (as JSON, up to
``max_result_bytes``) and adds to the attempt history (``ax_attempt``) the runs
that did not end their task: a retried failure (RETRY), a snoozed run (SNOOZED), a
run whose end moved nothing (CANCELLED; a recovery that declared it lost wrote first
and keeps its record), a success whose value was refused (with the note); and a
discarded run (DISCARDED), though it ends its task. A plain final end is the task
row itself: a task that succeeds at once costs no history write.
What goes into a text column is made storable first (:mod:`ax_kombu.worker.outcomes`:
no NUL, no lone surrogate, error text capped).

Guarantees:

* **A clean stop loses nothing.** :meth:`ResultWriter.stop` writes everything put
  before it returns.
* **No outcome stops the writer.** A write that fails because the store cannot be
  reached or cannot run the statement (:func:`~ax_kombu.store.engine.lost_connection`) is retried as it is,
  with backoff. A batch the store refuses for its data is split in halves until the
  refused outcome is alone; that run is recorded FAILED with the refusal as its
  ``last_error`` (its retries are not used: the same outcome would be refused again),
  and every other outcome of the batch is written as it is.
* **Bounded memory.** At most :attr:`ResultWriter.bound` (``2 × worker_batch_size``)
  outcomes wait to be durable; a pool thread whose outcome would pass that waits in
  :meth:`ResultWriter.put`, keeping its slot busy, until a batch is written.
* **Durable before done.** ``put(…, on_durable=…)`` is called back only once the
  outcome is committed (or found to move nothing). The worker's intake acks a run's
  message, and its pool frees the slot, when the outcome is *put*, not when it is
  durable; no state change is lost by that, because:
* **At-least-once.** If the process dies before an outcome is written, the task
  stays RUNNING with this worker as ``owner_node``, and the scheduler's recovery
  of a dead worker's tasks retries it. A stop that times out (:meth:`ResultWriter.stop`)
  gives up the same way.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from sqlalchemy import Connection

from ax_kombu.config import Settings
from ax_kombu.core.backoff import Uniform, default_rng
from ax_kombu.core.outcomes import Outcome
from ax_kombu.core.run_log import RunLog, RunLogBuffer
from ax_kombu.core.states import Status
from ax_kombu.exceptions import Retry
from ax_kombu.observability import metrics
from ax_kombu.store import Store, gates, run_logs, transitions
from ax_kombu.store.ends import EndWriter
from ax_kombu.store.pinned import PinnedConnection
from ax_kombu.store.tasks import wake_schedulers
from ax_kombu.store.transitions import DISCARDED, SNOOZED, Finish
from ax_kombu.worker.counters import Counters, Room
from ax_kombu.worker.outcomes import RunResult, decide, refused, stored_result
from ax_kombu.worker.processors import policy_of
from ax_kombu.worker.task import Ended

log = logging.getLogger(__name__)


def _result_not_stored(result: RunResult, finish: Finish) -> bool:
    """A success whose return value was refused (the history row carries the note)."""
    return (finish.status is Status.SUCCESS and result.outcome.value is not None
            and finish.result is None)


#: the attempt history's word for each way a run ends
_OUTCOMES = {Status.SUCCESS: "SUCCESS", Status.FAILED: "FAILED", Status.DELAYED: "RETRY"}


@functools.cache
def _children(queue_name: str, kind: str, type_label: str) -> tuple[Any, Any]:
    """The labelled metrics of one (queue, outcome, type label): looked up once, not per
    task."""
    return (metrics.execute_total.labels(queue=queue_name, result=kind, task_type=type_label),
            metrics.execute_duration.labels(queue=queue_name))


#: the worker's counter of each way a run ends (``ResultWriter.stats``)
_COUNTED: dict[str | Status | None, str] = {
    Status.SUCCESS: "succeeded", Status.FAILED: "failed", Status.DELAYED: "retried",
    SNOOZED: "snoozed", DISCARDED: "discarded"}

#: the ``result`` label of a run its processor ended with ax.Retry, ax.Snooze or ax.Discard
_ASKED = {SNOOZED: "snooze", DISCARDED: "discard"}


def _kind(result: RunResult, finish: Finish) -> str:
    """A run's ``result`` label in ``ax_execute_total``."""
    outcome = result.outcome
    if outcome.ok:
        return "success"
    if outcome.timed_out:
        return "timeout"
    if outcome.abandoned is not None:
        return "abandoned"
    if finish.kind is not None:
        return _ASKED[finish.kind]
    return "retry" if isinstance(outcome.error, Retry) else "error"


def _observe(batch: list[RunResult], finishes: list[Finish]) -> None:
    """A batch's runs in the metrics: a count per (queue, outcome, type label), durations,
    retry counts."""
    runs: dict[tuple[str, str, str], list[float]] = {}
    for result, finish in zip(batch, finishes, strict=True):
        kind = _kind(result, finish)
        key = (result.task.priority, kind, metrics.type_label(result.task.task_type))
        runs.setdefault(key, []).append(result.outcome.duration_s)
    for (queue_name, kind, type_label), durations in runs.items():
        total, duration = _children(queue_name, kind, type_label)
        total.inc(len(durations))
        if kind == "timeout":
            metrics.execute_timeout_total.inc(len(durations))
        metrics.observe_many(duration, durations)
    metrics.observe_many(metrics.retry_count, [
        result.task.retry_count for result, finish in zip(batch, finishes, strict=True)
        if finish.status is not Status.DELAYED])


def _logged(batch: list[RunResult]) -> list[tuple[int, int, RunLog]]:
    """The lines each run of ``batch`` logged, for those that logged any
    (:mod:`ax_kombu.worker.runlog`; a run that is not a :class:`RunTask` logs none here)."""
    logged = []
    for result in batch:
        buffer = getattr(result.task, "logs", None)
        kept = buffer.snapshot() if isinstance(buffer, RunLogBuffer) else None
        if kept is not None:
            logged.append((result.task.task_id, result.task.attempt, kept))
    return logged


class _Ended(NamedTuple):
    """An outcome and the end decided for it."""

    queued: _Queued
    finish: Finish


class _Queued(NamedTuple):
    """An outcome waiting in the writer's inbox."""

    result: RunResult
    #: called on the writer's thread once the outcome is durable (or moved nothing)
    on_durable: Callable[[], None] | None
    #: it took one of the inbox's places (an abandoned run's outcome does not wait for one)
    took_room: bool


class ResultWriter:
    """Collects outcomes from any thread; one thread writes them in batches."""

    def __init__(self, store: Store, settings: Settings, stats: Counters, *,
                 rng: Uniform | None = None, node: str | None = None) -> None:
        self.store = store
        self.node = node
        self.settings = settings
        self.stats = stats
        self.rng = rng or default_rng()
        #: most outcomes put and not durable yet (see :meth:`put`)
        self.bound = 2 * settings.worker_batch_size
        self._room = Room(self.bound)
        self._inbox: queue.SimpleQueue[_Queued] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._abort = threading.Event()
        self._db = PinnedConnection(store.engine)
        self._moved: set[int] = set()
        self._ends: EndWriter[_Ended] = EndWriter(
            self._record, self._refuse, written=self._written, aborted=self._abort.is_set,
            abandon=self._abandoned)
        self._thread = threading.Thread(target=self._run, name="ax-results", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def put(self, task: Ended, outcome: Outcome,
            on_durable: Callable[[], None] | None = None) -> None:
        """Queue the outcome of one run for writing (thread-safe).

        At most :attr:`bound` (``2 × worker_batch_size``) outcomes wait, in memory, for
        their batch to be durable: a thread whose outcome would exceed that waits here
        until a batch is written (a pool thread: its slot stays busy meanwhile, and so
        its lane takes no more work than it can record). It never waits for a writer
        that is not running, has been given up on, or for an abandoned run's outcome
        (those are reported by the thread stopping the worker, at shutdown).

        Args:
            on_durable: called (on the writer's thread) once the outcome is committed,
                or found to move nothing; never if the writer is given up on first.
        """
        result = RunResult(task, outcome, int(self.store.clock.local_ms()))  # before a wait
        took_room = outcome.abandoned is None and self._wait_for_room()
        self._inbox.put(_Queued(result, on_durable, took_room))

    def _wait_for_room(self) -> bool:
        """Take a place in the inbox, waiting while all are taken; False: taken none."""
        if self._room.take(0.0):
            return True
        self.stats.add("outcome_waits")
        while not self._room.take(0.1):
            if self._abort.is_set() or not self._thread.is_alive():
                return False
        return True

    def stop(self, timeout_s: float = 30.0) -> bool:
        """Write everything put so far, then stop; False if that took over ``timeout_s``."""
        self._stopping.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self._abort.set()
            self._thread.join(1.0)
            return False
        return True

    def _run(self) -> None:
        while True:
            batch = self._collect()
            if batch:
                self._write(batch)
            elif self._stopping.is_set() and self._inbox.empty():
                self._db.close()
                return

    def _collect(self) -> list[_Queued]:
        """The next batch: what arrives within ``worker_batch_ms`` of its first result.

        The window is slept through rather than waited on result by result: a
        thread blocked on the queue is woken by every put, a cost paid per task.
        """
        try:
            batch = [self._inbox.get(timeout=0.05)]
        except queue.Empty:
            return []
        if not self._stopping.is_set():
            time.sleep(self.settings.worker_batch_ms / 1000.0)
        while len(batch) < self.settings.worker_batch_size:
            try:
                batch.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        return batch

    def _write(self, batch: list[_Queued]) -> None:
        """Write ``batch`` with the :class:`~ax_kombu.store.ends.EndWriter`: an outage is
        waited out, and an outcome the store refuses for its data is recorded FAILED with
        the reason while the others are written as they are."""
        self._ends.write([_Ended(q, decide(q.result, self.settings, self.rng,
                                           policy_of(q.result.task.processor)))
                          for q in batch])

    def _record(self, ends: Sequence[_Ended]) -> None:
        """One batch in one transaction (the :class:`EndWriter`'s ``record``)."""
        with self._db.begin() as conn:
            self._moved = self._store(conn, [e.queued.result for e in ends],
                                      [e.finish for e in ends])

    def _written(self, ends: Sequence[_Ended]) -> None:
        """A batch is committed: count it, free its room, tell who asked."""
        self._account([e.queued.result for e in ends], [e.finish for e in ends], self._moved)
        self._settled([e.queued for e in ends], durable=True)

    def _abandoned(self, ends: Sequence[_Ended]) -> None:
        """A stop that timed out gave up on ``ends``: their room is freed, nobody told."""
        self._settled([e.queued for e in ends], durable=False)

    def _refuse(self, end: _Ended, error: Exception) -> _Ended:
        """The FAILED record of a run whose outcome the store refused, with the reason."""
        failed = refused(end.queued.result.ended_ms, end.finish, error)
        log.error("a run's outcome was refused by the store; recording the task FAILED",
                  extra={"task_id": failed.task_id, "trace_id": end.queued.result.task.trace_id,
                         "attempt": failed.attempt, "error": failed.error})
        self.stats.add("refused_results")
        return _Ended(end.queued, failed)

    def _store(self, conn: Connection, batch: list[RunResult],
               finishes: list[Finish]) -> set[int]:
        """The batch's state changes, history rows and wake-ups; returns the ids moved."""
        moved = set(transitions.finish_many(conn, finishes))
        transitions.record_attempts(conn, [  # a plain final end: the task row
            self._attempt(r, f, f.task_id in moved)
            for r, f in zip(batch, finishes, strict=True)
            if f.status is Status.DELAYED or f.task_id not in moved or f.kind is not None
            or _result_not_stored(r, f)])
        retries = [f.at_ms for f in finishes if f.status is Status.DELAYED and f.task_id in moved]
        if retries:  # due soon: schedulers load it now, not at the next preload
            wake_schedulers(conn, min(retries))
        gates.wake_next(conn, [(r.task.task_type, r.task.order_key)
                               for r in batch if r.task.gated])
        run_logs.write_logs(conn, _logged(batch), int(self.store.clock.local_ms()))
        return moved

    def _settled(self, batch: list[_Queued], *, durable: bool) -> None:
        """A batch is done with: free its inbox places, tell who asked (if durable)."""
        taken = sum(q.took_room for q in batch)
        if taken:
            self._room.give(taken)
        if not durable:
            return
        for q in batch:
            if q.on_durable is not None:
                try:
                    q.on_durable()
                except Exception:
                    log.exception("an on_durable callback failed",
                                   extra={"task_id": q.result.task.task_id})

    def _attempt(self, result: RunResult, finish: Finish, moved: bool) -> transitions.Attempt:
        """The history row of a run: how it ended here. A run whose end did not move its
        task (cancelled or recovered meanwhile) is recorded CANCELLED, unless the recovery
        recorded it first."""
        task, outcome = result.task, result.outcome
        error = finish.error
        if _result_not_stored(result, finish):
            error = stored_result(outcome.value, self.settings.max_result_bytes)[1]
        return transitions.Attempt(
            task_id=task.task_id, attempt=task.attempt, task_type=task.task_type,
            node=self.node, trigger_time=task.trigger_time, dispatched_at=task.dispatched_at,
            started_at=task.started_at, finished_at=result.ended_ms,
            outcome=(finish.kind or _OUTCOMES[finish.status]) if moved else "CANCELLED",
            error=error, duration_ms=round(outcome.duration_s * 1000))

    def _account(self, batch: list[RunResult], finishes: list[Finish], moved: set[int]) -> None:
        _observe(batch, finishes)
        succeeded = 0
        for result, finish in zip(batch, finishes, strict=True):
            if result.outcome.ok and finish.task_id in moved:  # the common case, counted once
                succeeded += 1
                continue
            extra = {"task_id": finish.task_id, "trace_id": result.task.trace_id,
                     "attempt": finish.attempt, "status": str(finish.status)}
            if result.outcome.timed_out:
                self.stats.add("timed_out")
            if finish.task_id not in moved:
                self.stats.add("stale_results")
                log.info("result not recorded: the task was cancelled or recovered meanwhile",
                         extra=extra)
                continue
            self.stats.add(_COUNTED.get(finish.kind) or _COUNTED[finish.status])
            if finish.kind == SNOOZED:
                log.info("task run snoozed", extra={**extra, "error": finish.error})
            elif finish.status is not Status.SUCCESS:
                log.warning("task run failed", extra={**extra, "error": finish.error})
        if succeeded:
            self.stats.add("succeeded", succeeded)
