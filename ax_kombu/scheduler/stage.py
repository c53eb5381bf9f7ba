"""What the scheduler's stages share: the hand-off between two stages, and the stage thread.

A :class:`HandOff` is the only place two stages meet: a deque that any thread
appends to and exactly one stage reads, plus an event that wakes that reader.
The reader re-checks the deque after every wake-up, so a wake-up that races
with a ``clear()`` delays an item by at most one sleep (``MAX_SLEEP_S``),
never loses it.

A :class:`Stage` is one daemon thread with a start/stop pair: ``stop()`` only
sets flags (the thread ends after its current step, and any back-off is cut
short); ``join()`` waits for it. A stage that meets a database error logs it
and backs off ``DB_BACKOFF_S`` on its own thread; a database error never ends
a stage.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterable
from typing import Generic, TypeVar

from sqlalchemy.exc import SQLAlchemyError

log = logging.getLogger(__name__)

#: longest any stage sleeps before looking at its stop flag again
MAX_SLEEP_S = 0.25
#: how long a stage waits after a database error before trying again
DB_BACKOFF_S = 1.0

T = TypeVar("T")


class HandOff(Generic[T]):
    """Items from any thread to one reading stage: ``items`` (a deque) plus ``ready`` (an event).

    Only the reader takes items out; it may put items it could not handle back
    at the front. ``ready`` is also set to make the reader look at its stop flag.
    """

    def __init__(self) -> None:
        self.items: deque[T] = deque()
        self.ready = threading.Event()

    def __len__(self) -> int:
        return len(self.items)

    def put(self, items: Iterable[T]) -> None:
        """From any thread: append ``items`` and wake the reader."""
        self.items.extend(items)
        self.ready.set()

    def wait(self, timeout: float) -> None:
        """For the reader: sleep until woken or ``timeout`` seconds pass."""
        if self.ready.wait(timeout):
            self.ready.clear()


class Stage(threading.Thread):
    """One stage of a scheduler node on its own daemon thread; ``run()`` until :meth:`stop`.

    Args:
        name: the thread's name (``ax-…``), as seen in thread dumps.
        wake: the event the stage sleeps on; :meth:`stop` sets it.
    """

    def __init__(self, name: str, wake: threading.Event) -> None:
        super().__init__(name=name, daemon=True)
        self._wake = wake
        self._stopped = threading.Event()

    @property
    def stopping(self) -> bool:
        return self._stopped.is_set()

    def stop(self) -> None:
        """Ask the stage to end after its current step; cuts a back-off short. Does not wait."""
        self._stopped.set()
        self._wake.set()

    def pause(self, seconds: float) -> None:
        """Sleep ``seconds``, less if :meth:`stop` is called meanwhile."""
        self._stopped.wait(seconds)

    def db_failed(self, what: str, exc: SQLAlchemyError) -> None:
        """Log a database error and back off before the next try."""
        log.warning("database unavailable; backing off", extra={"during": what}, exc_info=exc)
        self.pause(DB_BACKOFF_S)
