"""Wake-ups from producers to schedulers: PostgreSQL LISTEN/NOTIFY.

A producer that writes a task due inside the window schedulers have already
loaded sends ``NOTIFY ax_wakeup`` in its transaction; each scheduler keeps
one extra connection LISTENing and wakes its loop, which preloads at once.
A missed notification costs latency, never a task: the periodic preload
still finds the row. SQLite has no such channel; there the scheduler polls
(see ``Scheduler``).
"""

from __future__ import annotations

import logging
import select
import threading
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine

from ax_kombu.store.tasks import WAKE_CHANNEL

log = logging.getLogger(__name__)


class WakeListener(threading.Thread):
    """A daemon thread that calls ``on_wake()`` for every NOTIFY on ``ax_wakeup``."""

    def __init__(self, engine: Engine, on_wake: Callable[[], None]) -> None:
        super().__init__(name="ax-wake-listener", daemon=True)
        self._engine = engine
        self._on_wake = on_wake
        self._stop = threading.Event()

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        while not self._stop.is_set():
            try:
                self._listen()
            except Exception:
                log.warning("wake listener lost its connection; retrying", exc_info=True)
                self._stop.wait(2.0)

    def _listen(self) -> None:
        raw: Any = self._engine.raw_connection()
        try:
            pg = raw.driver_connection
            pg.autocommit = True
            with pg.cursor() as cursor:
                cursor.execute(f"LISTEN {WAKE_CHANNEL}")
            while not self._stop.is_set():
                if select.select([pg], [], [], 0.5)[0]:
                    pg.poll()
                    if pg.notifies:
                        pg.notifies.clear()
                        self._on_wake()
        finally:
            raw.invalidate()
