"""The batched result writer: run outcomes become SUCCESS, FAILED or DELAYED rows.

Pool threads hand every outcome to :meth:`ResultWriter.put` (a lock-free
queue append). One writer thread turns them into state changes and writes
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
  → FAILED with ``finished_at`` and ``last_error``.

Every write is fenced by attempt and status RUNNING: a task cancelled or
recovered by a scheduler meanwhile is left alone (counted as ``stale``).

The same transaction stores a success's return value (as JSON, up to
``max_result_bytes``) and adds to the attempt history (``ax_attempt``) the runs
that did not end their task: a retried failure (RETRY), a run whose end moved
nothing (CANCELLED; a recovery that declared it lost wrote first and keeps its
record), a success whose value was refused (with the note). A plain final end
is the task row itself: a task that succeeds at once costs no history write.

Guarantees: :meth:`ResultWriter.stop` writes everything put before it
returns, so a clean stop loses no state change. A database outage is
retried (results wait in memory; there is at most one per running task).
If the process dies before a result is written, the task stays RUNNING
with this worker as ``last_run_node``, and the scheduler's recovery of a
dead worker's tasks retries it: execution is at-least-once.
"""

from __future__ import annotations

import functools
import json
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import SQLAlchemyError

from ax_kombu.broker.messages import TaskMessage
from ax_kombu.config import Settings, redact_url
from ax_kombu.core import states
from ax_kombu.core.backoff import Uniform, backoff_ms, default_rng
from ax_kombu.core.states import Status
from ax_kombu.exceptions import ProcessorRefused
from ax_kombu.observability import metrics
from ax_kombu.store import Store, gates, transitions
from ax_kombu.store.tasks import wake_schedulers
from ax_kombu.store.transitions import Finish
from ax_kombu.worker.pools import Outcome

log = logging.getLogger(__name__)

#: longest last_error stored
MAX_ERROR = 2000


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
    return result.outcome.ok and result.outcome.value is not None and finish.result is None


#: the attempt history's word for each way a run ends
_OUTCOMES = {Status.SUCCESS: "SUCCESS", Status.FAILED: "FAILED", Status.DELAYED: "RETRY"}


class RunResult(NamedTuple):
    """One outcome, with the task it belongs to and when it ended (DB clock)."""

    task: TaskMessage
    outcome: Outcome
    ended_ms: int


def describe(result: RunResult) -> str:
    """The text stored in ``last_error`` for a run that did not succeed."""
    outcome, task = result.outcome, result.task
    if outcome.timed_out:
        text = f"timed out after {task.timeout_ms} ms"
    elif outcome.abandoned is not None:
        text = f"abandoned: {outcome.abandoned}"
    elif outcome.error is not None:
        text = f"{type(outcome.error).__name__}: {outcome.error}"
    else:
        text = "failed"
    return redact_url(text)[:MAX_ERROR]  # a callback's URL may carry a token


def stored_result(value: Any, limit: int) -> tuple[str | None, str | None]:
    """A processor's return value as stored: ``(json_text, note)``. None is stored as
    nothing; a value that is not JSON, or over ``limit`` bytes, is not stored and the note
    says why (the run is still a success)."""
    if value is None:
        return None, None
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError) as exc:
        return None, f"result not stored: not JSON ({type(exc).__name__}: {exc})"[:MAX_ERROR]
    size = len(text.encode())
    if size > limit:
        return None, f"result not stored: {size} bytes, over AX_MAX_RESULT_BYTES ({limit})"
    return text, None


def decide(result: RunResult, settings: Settings, rng: Uniform) -> Finish:
    """The state change a run's outcome leads to (see the module docstring)."""
    task, outcome = result.task, result.outcome
    if outcome.ok:
        stored, _ = stored_result(outcome.value, settings.max_result_bytes)
        return Finish(task.task_id, task.attempt, Status.SUCCESS, result.ended_ms,
                      result=stored, started_at=task.started_at)
    error = describe(result)
    final = isinstance(outcome.error, ProcessorRefused) or task.retry_count >= task.max_retry
    if final:
        return Finish(task.task_id, task.attempt, Status.FAILED, result.ended_ms, error,
                      started_at=task.started_at)
    delay = backoff_ms(task.retry_count, settings.retry_backoff_base_ms,
                       settings.retry_backoff_max_ms, rng, settings.retry_backoff_jitter)
    return Finish(task.task_id, task.attempt, Status.DELAYED, result.ended_ms + delay, error,
                  started_at=task.started_at)


@functools.cache
def _children(queue_name: str, kind: str, type_label: str) -> tuple[Any, Any]:
    """The labelled metrics of one (queue, outcome, type label): looked up once, not per
    task."""
    return (metrics.execute_total.labels(queue=queue_name, result=kind, task_type=type_label),
            metrics.execute_duration.labels(queue=queue_name))


def _observe(batch: list[RunResult], finishes: list[Finish]) -> None:
    """A batch's runs in the metrics: a count per (queue, outcome, type label), durations,
    retry counts."""
    runs: dict[tuple[str, str, str], list[float]] = {}
    for result in batch:
        outcome = result.outcome
        kind = ("success" if outcome.ok else "timeout" if outcome.timed_out
                else "abandoned" if outcome.abandoned is not None else "error")
        key = (result.task.priority, kind, metrics.type_label(result.task.task_type))
        runs.setdefault(key, []).append(outcome.duration_s)
    for (queue_name, kind, type_label), durations in runs.items():
        total, duration = _children(queue_name, kind, type_label)
        total.inc(len(durations))
        if kind == "timeout":
            metrics.execute_timeout_total.inc(len(durations))
        metrics.observe_many(duration, durations)
    metrics.observe_many(metrics.retry_count, [
        result.task.retry_count for result, finish in zip(batch, finishes, strict=True)
        if finish.status is not Status.DELAYED])


class ResultWriter:
    """Collects outcomes from any thread; one thread writes them in batches."""

    def __init__(self, store: Store, settings: Settings, stats: Counters, *,
                 rng: Uniform | None = None, node: str | None = None) -> None:
        self.store = store
        self.node = node
        self.settings = settings
        self.stats = stats
        self.rng = rng or default_rng()
        self._inbox: queue.SimpleQueue[RunResult] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._abort = threading.Event()
        self._db = HeldConnection(store.engine)
        self._thread = threading.Thread(target=self._run, name="ax-results", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def put(self, task: TaskMessage, outcome: Outcome) -> None:
        """Queue the outcome of one run for writing (thread-safe, never blocks)."""
        self._inbox.put(RunResult(task, outcome, int(self.store.clock.local_ms())))

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

    def _collect(self) -> list[RunResult]:
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

    def _write(self, batch: list[RunResult]) -> None:
        finishes = [decide(r, self.settings, self.rng) for r in batch]
        pause = 0.05
        while True:
            try:
                with self._db.begin() as conn:
                    moved = set(transitions.finish_many(conn, finishes))
                    transitions.record_attempts(conn, [  # a plain final end: the task row
                        self._attempt(r, f, f.task_id in moved)
                        for r, f in zip(batch, finishes, strict=True)
                        if f.status is Status.DELAYED or f.task_id not in moved
                        or _result_not_stored(r, f)])
                    retries = [f.at_ms for f in finishes
                               if f.status is states.Status.DELAYED and f.task_id in moved]
                    if retries:  # due soon: schedulers load it now, not at the next preload
                        wake_schedulers(conn, min(retries))
                    gates.wake_next(conn, [(r.task.task_type, r.task.order_key)
                                           for r in batch if r.task.gated])
                break
            except Exception:  # a database outage: keep the results, retry
                if self._abort.is_set():
                    log.error("results not written; the scheduler recovers these tasks",
                              extra={"count": len(batch)})
                    return
                log.warning("could not write results; retrying", exc_info=True,
                            extra={"count": len(batch)})
                time.sleep(pause)
                pause = min(pause * 2, 2.0)
        self._account(batch, finishes, moved)

    def _attempt(self, result: RunResult, finish: Finish, moved: bool) -> transitions.Attempt:
        """The history row of a run: how it ended here. A run whose end did not move its
        task (cancelled or recovered meanwhile) is recorded CANCELLED, unless the recovery
        recorded it first."""
        task, outcome = result.task, result.outcome
        error = finish.error
        if outcome.ok and outcome.value is not None and finish.result is None:
            error = stored_result(outcome.value, self.settings.max_result_bytes)[1]
        return transitions.Attempt(
            task.task_id, task.attempt, task.task_type, self.node, task.trigger_time,
            task.dispatched_at, task.started_at, result.ended_ms,
            _OUTCOMES[finish.status] if moved else "CANCELLED", error,
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
            self.stats.add({Status.SUCCESS: "succeeded", Status.FAILED: "failed",
                            Status.DELAYED: "retried"}[finish.status])
            if finish.status is not Status.SUCCESS:
                log.warning("task run failed", extra={**extra, "error": finish.error})
        if succeeded:
            self.stats.add("succeeded", succeeded)
