"""Writing the ends of Celery runs in batches, off the pool threads: :class:`EndWriter`.

A pool thread of the worker's main process (the ``threads``, ``solo``, ``gevent`` and
``eventlet`` pools) hands the end of a run (:class:`~ax_kombu.celery.fence.End`) here and
goes on; one daemon thread writes every end waiting, in one statement
(:meth:`ax_kombu.celery.fence.Fence.record`), and tries a batch again with a doubling pause
while the store cannot be reached. A batch the store refuses for its data is halved until
the refused end is alone, which is recorded FAILED with the reason, and the others are
written (as the ax worker's :class:`~ax_kombu.worker.results.ResultWriter` does): one bad
end never holds the rest RUNNING. At 500 runs a second this is one write per batch instead
of one per run on the worker's one interpreter lock.

Contract: an end is written at least once the store is reachable, unless the process
dies first; then its row stays RUNNING on a node that stops heartbeating, and ax's
recovery retries it (at-least-once, as for any run cut short). :meth:`EndWriter.flush`
waits until everything handed over is written (the bootstep's stop). A prefork child
writes its ends itself (a child may exit without running its threads to the end).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ax_kombu.store.engine import lost_connection
from ax_kombu.worker.outcomes import refused, refused_alone

if TYPE_CHECKING:
    from ax_kombu.celery.fence import End, Fence

log = logging.getLogger(__name__)
#: most ends in one write
MAX_BATCH = 500
#: the longest pause between two tries of a batch the store refused
BACKOFF_MAX_S = 5.0


class EndWriter:
    """One writer thread for the ends of one process's runs (see the module docstring)."""

    def __init__(self, fence: Fence) -> None:
        self._fence = fence
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
            self._write(batch)
            for _ in batch:
                self._queue.task_done()

    def _write(self, batch: list[End]) -> None:
        """Write ``batch``, halving it while the store refuses its data (see the module
        docstring)."""
        for end, error in refused_alone(batch, self._record):
            failed = end._replace(finish=refused(end.ended_at, end.finish, error))
            log.error("a Celery run's end was refused by the store; recording the task FAILED",
                      extra={"task_id": end.finish.task_id, "attempt": end.finish.attempt,
                             "error": failed.finish.error})
            while self._record([failed]) is not None:  # not this end's text: as an outage
                time.sleep(BACKOFF_MAX_S)

    def _record(self, batch: Sequence[End]) -> Exception | None:
        """Write ``batch``, waiting while the store cannot be reached; None once written,
        else the error with which the store refused the batch's data."""
        pause = 0.05
        while True:
            try:
                self._fence.record(batch)
                return None
            except Exception as exc:
                if not lost_connection(exc):
                    return exc
                log.warning("could not record Celery runs' ends in ax; trying again",
                            exc_info=True, extra={"count": len(batch)})
                time.sleep(pause)
                pause = min(pause * 2, BACKOFF_MAX_S)
