"""ax-worker: receive → RUNNING → run → record → ack, one bounded pool per queue.

:mod:`~ax_kombu.worker.node` is the lifecycle (start, signals, shutdown);
the consumer receives, :mod:`~ax_kombu.worker.lanes` plans each message into
its queue's :mod:`~ax_kombu.worker.pools` pool, :mod:`~ax_kombu.worker.receipts`
writes the RUNNING moves, :mod:`~ax_kombu.worker.results` the outcomes, and
:mod:`~ax_kombu.worker.processors` resolves what a task runs.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "Worker":  # imported on first use: the package stays light to import
        from ax_kombu.worker.node import Worker
        return Worker
    raise AttributeError(name)
