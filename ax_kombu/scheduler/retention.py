"""Retention: with ``AX_RETENTION`` set, a scheduler archives finished tasks continuously.

Every ``retention_interval_s`` (first one interval after the node starts), the
loop moves the tasks that finished more than ``retention`` ms ago, with their
attempts, into the archive tables, ``retention_batch`` per transaction with a pause
of ``retention_pause_ms`` after each, until none is left or the node stops (:func:`ax_kombu.store.archive.archive_finished`: the
guarantees are there). It holds nothing else while it runs and shares no state
with the other loops, only the store's connection pool.

Every scheduler with ``AX_RETENTION`` runs it; one would be enough, and several at
once are safe: a batch skips the rows another node's batch holds
(``FOR UPDATE SKIP LOCKED``; on SQLite the write lock serialises them). A database
error is logged and the next pass tries again; it never ends the node. A stop
ends the pass after the batch under way (committed or rolled back whole).
"""

from __future__ import annotations

import logging
import threading

from ax_kombu.config import Settings
from ax_kombu.exceptions import AxError
from ax_kombu.scheduler.loop import Loop
from ax_kombu.store import Store
from ax_kombu.store.archive import Pace, archive_finished

log = logging.getLogger(__name__)


class Retention(Loop):
    """Archives finished tasks older than ``settings.retention`` every
    ``settings.retention_interval_s``; :meth:`start` does nothing when retention is off."""

    def __init__(self, settings: Settings, store: Store) -> None:
        super().__init__("ax-retention", threading.Event())
        self._settings = settings
        self._store = store

    def start(self) -> None:
        if self._settings.retention > 0:
            super().start()

    def run(self) -> None:
        while not self.stopping:
            self.pause(self._settings.retention_interval_s)
            if not self.stopping:
                self.run_once()

    def run_once(self) -> None:
        """One pass: archive until nothing old is left or the node stops."""
        try:
            pace = Pace(self._settings.retention_pause_ms / 1000, lambda: self.stopping,
                        self.pause)
            done = archive_finished(self._store.engine, self._settings.retention,
                                    batch=self._settings.retention_batch, pace=pace)
        except AxError as exc:
            log.warning("retention pass failed; trying again next interval",
                        extra={"error": str(exc)})
            return
        if done.tasks:
            log.info("archived finished tasks",
                     extra={"tasks": done.tasks, "attempts": done.attempts,
                            "batches": done.batches})
