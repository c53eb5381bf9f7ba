"""Writing run ends in batches: one writer for ax runs and Celery runs.

:class:`EndWriter` writes a batch of ends with the caller's ``record`` (one transaction,
one statement per kind of row) and guarantees, whatever the ends are:

* **An outage is waited out.** A write that fails because the store cannot be reached
  or cannot run the statement (:func:`~ax_kombu.store.engine.lost_connection`) is tried
  again as it is, with a doubling pause, until it is written or the caller gives up
  (``aborted``); given-up ends go to ``abandon`` (their tasks stay RUNNING, and the
  recovery of a node that stops heartbeating retries them: at-least-once).
* **One bad end never holds the rest.** A batch the store refuses for its data is halved
  until the refused end is alone (:func:`refused_alone`: about 2 log2(n) writes for one
  among n); the others are written as they are. The refused end is replaced by the
  caller's ``refuse`` (with :func:`refused`: FAILED, naming the refusal) and written; if
  the store refuses even that, the cause is not the end's text and it is retried as an
  outage.

Takes no worker object: the ax worker's result writer and the Celery bootstep each give
their own ``record``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from ax_kombu.config import redact_url
from ax_kombu.core.outcomes import MAX_ERROR, error_text, exception_text
from ax_kombu.core.states import Status
from ax_kombu.store.engine import lost_connection
from ax_kombu.store.transitions import Finish, storable

log = logging.getLogger(__name__)

T = TypeVar("T")


def clean_text(text: str) -> str:
    """A text as ax stores it: URLs and passwords redacted, storable in both stores."""
    return storable(redact_url(text))


def refused(ended_ms: int, finish: Finish, error: BaseException) -> Finish:
    """The end recorded for a run whose end the store refused (for its data, not for a
    lost connection): FAILED when the run ended, ``last_error`` naming the refusal and the
    end it replaces, in plain ASCII; no result."""
    text = f"outcome refused by the store ({exception_text(error)}); the run ended {finish.status}"
    if finish.error:
        text += f": {finish.error}"
    reason = error_text(text, clean_text).encode("ascii", "backslashreplace").decode()
    return Finish(finish.task_id, finish.attempt, Status.FAILED, ended_ms, reason[:MAX_ERROR],
                  started_at=finish.started_at)


def refused_alone(batch: Sequence[T], write: Callable[[Sequence[T]], Exception | None]
                  ) -> list[tuple[T, Exception]]:
    """Write ``batch`` with ``write`` (None: written, else the error with which the store
    refused the batch's data); a refused batch is halved until each refused item is alone
    (about 2 log2(n) writes for one among n), the others written as they are. Returns the
    items refused alone, each with its error, for the caller to record otherwise."""
    error = write(batch)
    if error is None:
        return []
    if len(batch) == 1:
        return [(batch[0], error)]
    half = len(batch) // 2
    return refused_alone(batch[:half], write) + refused_alone(batch[half:], write)


def _never() -> bool:
    return False


def _drop(batch: Sequence[T]) -> None:
    return None


class EndWriter(Generic[T]):
    """Writes batches of ends of type ``T`` (see the module docstring). Not thread-safe:
    one writer thread calls :meth:`write`.

    Args:
        record: writes one batch in one transaction; raises what the store raised.
        refuse: the end to write instead of one the store refused, given the error.
        written: told of each batch once it is committed (outside the retried block).
        aborted: True once the caller gives up on ends not written yet (e.g. a stop that
            timed out); checked between tries.
        abandon: told of the ends given up on.
        pause_max_s: the longest pause between two tries.
    """

    def __init__(self, record: Callable[[Sequence[T]], None],
                 refuse: Callable[[T, Exception], T], *,
                 written: Callable[[Sequence[T]], None] = _drop,
                 aborted: Callable[[], bool] = _never,
                 abandon: Callable[[Sequence[T]], None] = _drop,
                 pause_max_s: float = 2.0) -> None:
        self._record = record
        self._refuse = refuse
        self._written = written
        self._aborted = aborted
        self._abandon = abandon
        self._pause_max_s = pause_max_s

    def write(self, batch: Sequence[T]) -> None:
        """Write ``batch``, halving it while the store refuses its data; each end refused
        alone is replaced by its ``refuse`` and written."""
        for end, error in refused_alone(batch, self._try):
            failed = self._refuse(end, error)
            pause = 0.05
            while self._try([failed]) is not None:
                if self._aborted():
                    self._abandon([failed])
                    break
                log.error("the store refused a run's FAILED record too; retrying")
                time.sleep(pause)
                pause = min(pause * 2, self._pause_max_s)

    def _try(self, batch: Sequence[T]) -> Exception | None:
        """Write one batch, retrying while the store cannot be reached.

        Returns:
            None once it is written (or given up on), else the error with which the store
            refused the batch's data.
        """
        pause = 0.05
        while True:
            try:
                self._record(batch)
                break
            except Exception as exc:  # classified below: retried, or the batch is split
                if not lost_connection(exc):
                    log.warning("the store refused a batch of run ends",
                                exc_info=True, extra={"count": len(batch)})
                    return exc
                if self._aborted():
                    log.error("run ends not written; recovery retries these tasks",
                              extra={"count": len(batch)})
                    self._abandon(batch)
                    return None
                log.warning("could not write run ends; retrying", exc_info=True,
                            extra={"count": len(batch)})
                time.sleep(pause)
                pause = min(pause * 2, self._pause_max_s)
        self._written(batch)
        return None
