"""ax-worker: receive → RUNNING → run → record → ack, one bounded pool per queue.

:mod:`~ax_kombu.worker.node` lists the worker's steps (start order; stop in reverse) and
states the guarantees. Each received message is a run with one state
(:mod:`~ax_kombu.worker.run`). :mod:`~ax_kombu.worker.consumer` owns the broker connection
and receives; :mod:`~ax_kombu.worker.intake` puts together the planning of each run into
its queue's lane (:mod:`~ax_kombu.worker.planning`, :mod:`~ax_kombu.worker.lanes`) and
the RUNNING moves (:mod:`~ax_kombu.worker.receipts`), the start protocol on the lane's
executor (:mod:`~ax_kombu.worker.starts`, :mod:`~ax_kombu.worker.executor`,
:mod:`~ax_kombu.worker.pools`) and the acks (:mod:`~ax_kombu.worker.acks`);
:mod:`~ax_kombu.worker.listing` writes down the waiting runs that certainly have not
started; :mod:`~ax_kombu.worker.results` writes the outcomes;
:mod:`~ax_kombu.worker.shutdown` hands unstarted work back and lets running tasks finish.
:mod:`~ax_kombu.worker.control` keeps the flags and wake-up the threads share,
:mod:`~ax_kombu.worker.processors` resolves what a task runs.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "Worker":  # imported on first use: the package stays light to import
        from ax_kombu.worker.node import Worker
        return Worker
    raise AttributeError(name)
