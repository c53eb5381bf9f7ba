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
  ``retry_count + 1``, ``last_error``, ``last_run_node = NULL`` (a scheduler
  adopts it like any delayed task);
* otherwise, or a processor refused as not allowed (retrying cannot help)
  → FAILED with ``finished_at`` and ``last_error``;
* what the processor said its failure means (``ax.Retry``, ``ax.Snooze``,
  ``ax.Discard``, its registration's ``retry_on`` and ``backoff``) comes first:
  :func:`~ax_kombu.worker.outcomes.decide` has the rules, this writer looks the
  registered policy up by the task's processor name.

Every write is fenced by attempt and status RUNNING: a task cancelled or
recovered by a scheduler meanwhile is left alone (counted as ``stale``).

The same transaction stores a success's return value (as JSON, up to
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
  stays RUNNING with this worker as ``last_run_node``, and the scheduler's recovery
  of a dead worker's tasks retries it. A stop that times out (:meth:`ResultWriter.stop`)
  gives up the same way.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import SQLAlchemyError

from ax_kombu.broker.messages import TaskMessage
from ax_kombu.config import Settings
from ax_kombu.core.backoff import Uniform, default_rng
from ax_kombu.core.states import Status
from ax_kombu.exceptions import Retry
from ax_kombu.observability import metrics
from ax_kombu.store import Store, gates, transitions
from ax_kombu.store.engine import lost_connection
from ax_kombu.store.tasks import wake_schedulers
from ax_kombu.store.transitions import DISCARDED, SNOOZED, Finish
from ax_kombu.worker.outcomes import RunResult, decide, refused, refused_alone, stored_result
from ax_kombu.worker.pools import Outcome
from ax_kombu.worker.processors import policy_of

log = logging.getLogger(__name__)


class HeldConnection:
    """One database connection kept by one thread between batches.

    A batch then costs its statement and commit only, not a pool checkout and
    its liveness ping. After an error the connection is dropped and the next
    :meth:`begin` opens a new one. With ``autocommit`` (PostgreSQL only), each
    statement commits by itself: one round trip instead of two, for callers
    whose statements are each atomic and independent of one another.
    """

    def __init__(self, engine: Engine, *, autocommit: bool = False) -> None:
        self.engine = engine
        self.autocommit = autocommit and engine.dialect.name == "postgresql"
        self._conn: Connection | None = None

    @contextmanager
    def begin(self) -> Iterator[Connection]:
        """A transaction on the held connection, committed when the block exits
        (in autocommit: the connection, each statement committed as it runs)."""
        if self._conn is None or self._conn.closed or self._conn.invalidated:
            conn = self.engine.connect()
            self._conn = (conn.execution_options(isolation_level="AUTOCOMMIT")
                          if self.autocommit else conn)
        try:
            if self.autocommit:
                yield self._conn
            else:
                with self._conn.begin():
                    yield self._conn
        except SQLAlchemyError:
            self.close()
            raise

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except SQLAlchemyError:
                pass


class Counters:
    """Thread-safe event counters of one worker (until Prometheus metrics replace them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def __getitem__(self, name: str) -> int:
        with self._lock:
            return self._counts[name]


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


class _Queued(NamedTuple):
    """An outcome waiting in the writer's inbox."""

    result: RunResult
    #: called on the writer's thread once the outcome is durable (or moved nothing)
    on_durable: Callable[[], None] | None
    #: it took one of the inbox's places (an abandoned run's outcome does not wait for one)
    holds_room: bool


class Room:
    """A count of free places, as :class:`threading.Semaphore`, that wakes a waiter only when
    one waits: CPython 3.11's ``Semaphore.release(n)`` notifies n times in a Python loop,
    which for a batch of outcomes cost more than writing down that they are durable."""

    def __init__(self, places: int) -> None:
        self._free = places
        self._waiting = 0
        self._cond = threading.Condition(threading.Lock())

    def take(self, timeout_s: float) -> bool:
        """Take a place, waiting at most ``timeout_s`` for one; False if none came."""
        with self._cond:
            if self._free <= 0 and timeout_s > 0:
                self._waiting += 1
                try:
                    self._cond.wait(timeout_s)
                finally:
                    self._waiting -= 1
            if self._free <= 0:
                return False
            self._free -= 1
            return True

    def give(self, places: int) -> None:
        """Free ``places`` places, waking as many waiters."""
        with self._cond:
            self._free += places
            if self._waiting:
                self._cond.notify(min(places, self._waiting))


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
        self._db = HeldConnection(store.engine)
        self._thread = threading.Thread(target=self._run, name="ax-results", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def put(self, task: TaskMessage, outcome: Outcome,
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
        holds_room = outcome.abandoned is None and self._wait_for_room()
        self._inbox.put(_Queued(result, on_durable, holds_room))

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
        """Write ``batch``. One the store refuses for its data is halved until the refused
        outcome is alone (:func:`~ax_kombu.worker.outcomes.refused_alone`), which is then
        recorded FAILED with the reason; the others are written as they are."""
        finishes = [decide(q.result, self.settings, self.rng, policy_of(q.result.task.processor))
                    for q in batch]
        for (queued, finish), error in refused_alone(
                list(zip(batch, finishes, strict=True)),
                lambda pairs: self._commit([q for q, _ in pairs], [f for _, f in pairs])):
            self._commit_refused(queued, finish, error)

    def _commit(self, batch: list[_Queued], finishes: list[Finish]) -> Exception | None:
        """Write one batch in one transaction, retrying while the store cannot be reached.

        Returns:
            None once it is written (or given up on at a stop that timed out), else the
            error with which the store refused the batch's data.
        """
        pause = 0.05
        while True:
            try:
                with self._db.begin() as conn:
                    moved = self._store(conn, [q.result for q in batch], finishes)
                break
            except Exception as exc:  # classified below: retried, or the batch is split
                if not lost_connection(exc):
                    log.warning("the store refused a batch of results",
                                exc_info=True, extra={"count": len(batch)})
                    return exc
                if self._abort.is_set():
                    log.error("results not written; the scheduler recovers these tasks",
                              extra={"count": len(batch)})
                    self._settled(batch, durable=False)
                    return None
                log.warning("could not write results; retrying", exc_info=True,
                            extra={"count": len(batch)})
                time.sleep(pause)
                pause = min(pause * 2, 2.0)
        self._account([q.result for q in batch], finishes, moved)
        self._settled(batch, durable=True)
        return None

    def _commit_refused(self, queued: _Queued, finish: Finish, error: Exception) -> None:
        """Record a run whose outcome the store refused as FAILED, with the reason. If the
        store refuses even that, the cause is not this outcome's text: it is retried
        like an outage."""
        failed = refused(queued.result.ended_ms, finish, error)
        log.error("a run's outcome was refused by the store; recording the task FAILED",
                  extra={"task_id": finish.task_id, "trace_id": queued.result.task.trace_id,
                         "attempt": finish.attempt, "error": failed.error})
        self.stats.add("refused_results")
        pause = 0.05
        while self._commit([queued], [failed]) is not None:
            if self._abort.is_set():
                self._settled([queued], durable=False)
                return
            log.error("the store refused a run's FAILED record too; retrying",
                      extra={"task_id": finish.task_id})
            time.sleep(pause)
            pause = min(pause * 2, 2.0)

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
        return moved

    def _settled(self, batch: list[_Queued], *, durable: bool) -> None:
        """A batch is done with: free its inbox places, tell who asked (if durable)."""
        held = sum(q.holds_room for q in batch)
        if held:
            self._room.give(held)
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
            task.task_id, task.attempt, task.task_type, self.node, task.trigger_time,
            task.dispatched_at, task.started_at, result.ended_ms,
            (finish.kind or _OUTCOMES[finish.status]) if moved else "CANCELLED", error,
            round(outcome.duration_s * 1000))

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
