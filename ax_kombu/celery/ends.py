"""The ends of Celery runs: the decision, the write, and the batched writer off the pool threads.

* **One decision**: a run's end is decided by :func:`ax_kombu.core.outcomes.decide`, the
  one ax runs take (:func:`end_of`): SUCCESS, or a failure retried with ax's back-off while
  retries are left, else FAILED; the stored error is the Celery run's.
* **One write per batch**: :func:`record` writes ends in one statement when all are SUCCESS
  of ungated runs, else in one transaction that also records the retries' history rows and
  wakes what waits on a gate. Fenced by attempt: a row recovered or cancelled meanwhile, or
  at another attempt, does not move.
* **Batched off the pool threads**: a pool thread of the worker's main process (the
  ``threads``, ``solo``, ``gevent`` and ``eventlet`` pools) hands the end of a run to an
  :class:`EndWriter` and goes on; one daemon thread writes every end waiting through the
  writer every run end takes (:class:`ax_kombu.store.ends.EndWriter`: an outage waited out
  with a doubling pause, a batch the store refuses for its data halved until the refused
  end is alone, which is recorded FAILED with the reason). At 500 runs a second this is one
  write per batch instead of one per run on the worker's one interpreter lock.

Contract: an end is written at least once the store is reachable, unless the process dies
first; then its row stays RUNNING on a node that stops heartbeating, and ax's recovery
retries it (at-least-once, as for any run cut short). :meth:`EndWriter.flush` waits until
everything handed over is written (the bootstep's stop). A prefork child writes its ends
itself (a child may exit without running its threads to the end).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from sqlalchemy import Connection

from ax_kombu.celery.node import ProcessStore
from ax_kombu.config import Settings
from ax_kombu.core.backoff import default_rng
from ax_kombu.core.outcomes import Outcome, decide
from ax_kombu.core.states import Status
from ax_kombu.store import ends as store_ends
from ax_kombu.store import gates as gate_store
from ax_kombu.store.tasks import wake_schedulers
from ax_kombu.store.transitions import Attempt, Finish, Started, finish_many, record_attempts

#: most ends in one write
MAX_BATCH = 500
#: the longest pause between two tries of a batch the store refused
BACKOFF_MAX_S = 5.0


class End(NamedTuple):
    """The end of one run, ready to write: the run as it started, its move, and the
    outcome its history row gets if it is retried (``RETRY``, or ``LOST``)."""

    task: Started
    finish: Finish
    outcome: str
    #: when the run ended (database clock, epoch ms)
    ended_at: int


class _Facts(NamedTuple):
    """What the decision reads of a Celery run (:class:`ax_kombu.core.outcomes.RunFacts`)."""

    attempt: int
    retry_count: int
    max_retry: int
    timeout_ms: int


def end_of(task: Started, attempt: int, error: str | None, result: str | None, now_ms: int,
           settings: Settings, *, outcome: str = "RETRY") -> End:
    """The end of a run started at ``attempt``: SUCCESS (``result``: JSON text) when
    ``error`` is None, else what :func:`~ax_kombu.core.outcomes.decide` makes of a failure
    (a retry with ax's back-off, or FAILED when none is left), with ``error`` stored; its
    history row says ``outcome`` if it is retried."""
    if error is None:
        return End(task, Finish(task.task_id, attempt, Status.SUCCESS, now_ms, result=result),
                   outcome, now_ms)
    facts = _Facts(attempt, task.retry_count, task.max_retry, task.timeout_ms)
    decision = decide(facts, Outcome(ok=False), now_ms, settings, default_rng(),
                      store_ends.clean_text)
    return End(task, Finish(task.task_id, attempt, decision.status, decision.at_ms, error),
               outcome, now_ms)


def record(stores: ProcessStore, node_id: str, ends: Sequence[End]) -> list[int]:
    """Write ``ends`` (see the module docstring); returns the ids that moved."""
    finishes = [e.finish for e in ends]
    if all(e.finish.status is Status.SUCCESS and not e.task.gated for e in ends):
        with stores.one_statement() as conn:
            return finish_many(conn, finishes)
    with stores.get().engine.begin() as conn:
        moved = finish_many(conn, finishes)
        _after(conn, node_id, ends, set(moved))
    return moved


def _after(conn: Connection, node_id: str, ends: Sequence[End], moved: set[int]) -> None:
    """In the ends' transaction: the retries' history rows, a wake for the schedulers, and
    what waits on a gate."""
    retried = [e for e in ends if e.finish.status is Status.DELAYED
               and e.finish.task_id in moved]
    if retried:
        record_attempts(conn, [Attempt(
            task_id=e.task.task_id, attempt=e.finish.attempt, task_type=e.task.task_type,
            node=node_id, trigger_time=e.task.trigger_time, dispatched_at=None,
            started_at=e.task.started_at, finished_at=e.ended_at, outcome=e.outcome,
            error=e.finish.error) for e in retried])
        wake_schedulers(conn, min(e.finish.at_ms for e in retried))
    gated = [(e.task.task_type, e.task.order_key) for e in ends if e.task.gated]
    if gated:
        gate_store.wake_next(conn, gated)


def _refuse(end: End, error: Exception) -> End:
    """The end written instead of one the store refused for its data: FAILED, naming why."""
    return end._replace(finish=store_ends.refused(end.ended_at, end.finish, error))


def _written(_: object) -> None:
    """What a batch's write returned, dropped: the writer only needs it to return."""


class EndWriter:
    """One writer thread for the ends of one process's runs (see the module docstring).

    Args:
        record: writes one batch of ends in one transaction; raises what the store raised.
    """

    def __init__(self, record: Callable[[Sequence[End]], object]) -> None:
        self._writer = store_ends.EndWriter(lambda batch: _written(record(batch)), _refuse,
                                            pause_max_s=BACKOFF_MAX_S)
        self._queue: queue.Queue[End] = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def put(self, end: End) -> None:
        """Hand over the end of one run; it is written soon, with the others waiting."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="ax-celery-ends",
                                                daemon=True)
                self._thread.start()
        self._queue.put(end)

    def flush(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until every end handed over is written; True if so."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while len(batch) < MAX_BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            self._writer.write(batch)
            for _ in batch:
                self._queue.task_done()
