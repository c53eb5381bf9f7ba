"""Pruning: a scheduler deletes what no reader needs any more, a bounded batch at a time.

Two of the housekeeper's steps (:mod:`ax_kombu.scheduler.housekeeper` runs them, isolated
and backed off as its other steps):

* **prune** — every ``PRUNE_INTERVAL_MS``: the ``ax_node`` rows of nodes stopped longer
  than ``node_retention_s`` ago (:func:`ax_kombu.store.nodes.prune_stopped`), and the
  duplicate check's entries of tasks created longer than ``fingerprint_retention_s`` ago
  and due before the dedup window (:func:`ax_kombu.store.tasks.prune_fingerprints`),
  ``PRUNE_BATCH`` a pass, the next batch ``PRUNE_AGAIN_MS`` later while batches come back
  full (the node rows wait until the entries are done).
* **due** — every ``DUE_PRUNE_INTERVAL_MS``: the ``ax_due`` entries of this node's share
  whose time passed ``DUE_PRUNE_AFTER_MS`` ago and whose task has moved on
  (:func:`ax_kombu.store.preload.prune_due`), ``PRUNE_BATCH`` a pass, again
  ``PRUNE_AGAIN_MS`` later while batches come back full.

Each deletes only rows no claim, preload or duplicate check reads again, each in a
transaction of its own; a pass that fails deletes nothing and the next pass tries again.
"""

from __future__ import annotations

import logging

from ax_kombu.config import Settings
from ax_kombu.core.ids import compose
from ax_kombu.observability import metrics
from ax_kombu.store import Store, nodes, preload
from ax_kombu.store import tasks as task_store

log = logging.getLogger(__name__)

#: how often the node rows are pruned
PRUNE_INTERVAL_MS = 600_000
#: the duplicate check's old entries are deleted this many at a time, one batch per pass
#: of the housekeeping loop (it also preloads: no pass holds it up for long), the next
#: batch PRUNE_AGAIN_MS later while batches come back full
PRUNE_BATCH = 10_000
PRUNE_AGAIN_MS = 1000
#: how often the ax_due entries whose task has moved on are pruned, and how long after
#: their time (an entry is written for each time a task is made due: at 2,000 tasks/s the
#: table keeps about 140,000 entries of the past)
DUE_PRUNE_INTERVAL_MS = 10_000
DUE_PRUNE_AFTER_MS = 60_000


class Pruner:
    """The housekeeper's ``prune`` and ``due`` steps; each returns when it is due next.

    Args:
        settings: the node's settings (``node_retention_s``, ``fingerprint_retention_s``,
            ``dedup_window_ms``).
        store: the task store.
    """

    def __init__(self, settings: Settings, store: Store) -> None:
        self._settings = settings
        self._store = store
        #: the last pass found more old duplicate-check entries than one batch
        self._pruning = False

    def prune(self, now: int) -> int:
        """Delete the rows of nodes stopped longer than ``node_retention_s`` ago, and the
        duplicate check's entries of tasks created longer than ``fingerprint_retention_s``
        ago and due before the dedup window (:func:`~ax_kombu.store.tasks.
        prune_fingerprints`), one batch a pass; returns when to prune next."""
        retention_ms = int(self._settings.node_retention_s * 1000)
        if retention_ms > 0 and not self._pruning:
            with self._store.engine.begin() as conn:
                pruned = nodes.prune_stopped(conn, now - retention_ms)
            if pruned:
                log.info("pruned the rows of long-stopped nodes",
                         extra={"nodes": len(pruned), "retention_s": retention_ms // 1000})
        keep_ms = int(self._settings.fingerprint_retention_s * 1000)
        if keep_ms > 0:
            with self._store.engine.begin() as conn:
                deleted = task_store.prune_fingerprints(
                    conn, compose(now - keep_ms, 0, 0), now - self._settings.dedup_window_ms,
                    PRUNE_BATCH)
            self._pruning = deleted == PRUNE_BATCH
            if deleted:
                log.info("pruned old entries of the duplicate check",
                         extra={"entries": deleted, "retention_s": keep_ms // 1000})
        return now + (PRUNE_AGAIN_MS if self._pruning else PRUNE_INTERVAL_MS)

    def prune_due(self, now: int, share: preload.Share) -> int:
        """Delete a batch of ``share``'s ``ax_due`` entries whose task has moved on
        (:func:`~ax_kombu.store.preload.prune_due`); returns when to prune them next: soon
        while batches come back full."""
        with self._store.engine.begin() as conn:
            deleted = preload.prune_due(conn, now - DUE_PRUNE_AFTER_MS, PRUNE_BATCH, share)
        metrics.due_pruned_total.inc(deleted)
        return now + (PRUNE_AGAIN_MS if deleted == PRUNE_BATCH else DUE_PRUNE_INTERVAL_MS)
