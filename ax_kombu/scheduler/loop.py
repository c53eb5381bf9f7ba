"""What the scheduler's loops share: the mailbox between two loops, and the loop thread.

A :class:`Mailbox` is the only place two loops meet: a deque that any thread
appends to and exactly one loop reads, plus an event that wakes that reader.
The reader re-checks the deque after every wake-up, so a wake-up that races
with a ``clear()`` delays an item by at most one sleep (``MAX_SLEEP_S``),
never loses it.

A :class:`Loop` is one daemon thread with a start/stop pair: ``stop()`` only
sets flags (the thread ends after its current step, and any back-off is cut
short); ``join()`` waits for it. A loop that meets a database error logs it
and backs off ``DB_BACKOFF_S`` on its own thread; a database error never ends
a loop.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterable
from typing import Generic, TypeVar

from sqlalchemy.exc import SQLAlchemyError

log = logging.getLogger(__name__)

#: longest any loop sleeps before looking at its stop flag again
MAX_SLEEP_S = 0.25
#: how long a loop waits after a database error before trying again
DB_BACKOFF_S = 1.0

T = TypeVar("T")


class Mailbox(Generic[T]):
    """Items from any thread to one reading loop: ``items`` (a deque) plus ``ready`` (an event).

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


class Loop(threading.Thread):
    """One loop of a scheduler node on its own daemon thread; ``run()`` until :meth:`stop`.

    Args:
        name: the thread's name (``ax-…``), as seen in thread dumps.
        wake: the event the loop sleeps on; :meth:`stop` sets it.
    """

    def __init__(self, name: str, wake: threading.Event) -> None:
        super().__init__(name=name, daemon=True)
        self._wake = wake
        self._stopped = threading.Event()

    @property
    def stopping(self) -> bool:
        return self._stopped.is_set()

    def stop(self) -> None:
        """Ask the loop to end after its current step; cuts a back-off short. Does not wait."""
        self._stopped.set()
        self._wake.set()

    def pause(self, seconds: float) -> None:
        """Sleep ``seconds``, less if :meth:`stop` is called meanwhile."""
        self._stopped.wait(seconds)

    def db_failed(self, what: str, exc: SQLAlchemyError) -> None:
        """Log a database error and back off before the next try."""
        log.warning("database unavailable; backing off", extra={"during": what}, exc_info=exc)
        self.pause(DB_BACKOFF_S)
