"""ax-scheduler: preload → timing wheel → batched claim → Kombu publish, plus recovery.

One node (:mod:`~ax_kombu.scheduler.node`: lifecycle, signals, shutdown) runs
its loops on their own threads: the timing loop
(:mod:`~ax_kombu.scheduler.timing`), the claimer
(:mod:`~ax_kombu.scheduler.claimer`), the dispatcher
(:mod:`~ax_kombu.scheduler.dispatcher`) and the housekeeper
(:mod:`~ax_kombu.scheduler.housekeeper`: preload, heartbeat, recovery). They
meet only at mailboxes and share one loop thread shape
(:mod:`~ax_kombu.scheduler.loop`).
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "Scheduler":  # imported on first use: the package stays light to import
        from ax_kombu.scheduler.node import Scheduler
        return Scheduler
    raise AttributeError(name)
