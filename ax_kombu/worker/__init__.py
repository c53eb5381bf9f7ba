"""ax-worker: receive → RUNNING → run → record → ack, one bounded pool per queue.

:mod:`~ax_kombu.worker.node` is the lifecycle (start, heartbeat, stop order)
and states the guarantees. Its stages: :mod:`~ax_kombu.worker.consumer` owns
the broker connection and receives; :mod:`~ax_kombu.worker.intake` plans each
message into its queue's lane (:mod:`~ax_kombu.worker.lanes`) and pool
(:mod:`~ax_kombu.worker.pools`), sends it through :mod:`~ax_kombu.worker.receipts`
(the RUNNING moves) and acks it when its run ends; :mod:`~ax_kombu.worker.results`
writes the outcomes; :mod:`~ax_kombu.worker.shutdown` hands unstarted work back
and lets running tasks finish. :mod:`~ax_kombu.worker.control` holds the flags
and wake-up the threads share, :mod:`~ax_kombu.worker.processors` resolves
what a task runs.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "Worker":  # imported on first use: the package stays light to import
        from ax_kombu.worker.node import Worker
        return Worker
    raise AttributeError(name)
