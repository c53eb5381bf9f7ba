"""The worker's runs in its pools: an index of runs, and the lock their waiting states share.

A run handed to its pool (:data:`~ax_kombu.worker.run.State.STAGED`) is in :attr:`Stage.runs`
until it is settled. Its state is the run's own (:class:`~ax_kombu.worker.run.Run`); this
index only finds the runs. Three threads move a waiting run: the pool thread that takes it
(→ STARTED), the listing's scan (STAGED ⇄ LISTED) and whoever withdraws the stage
(→ WITHDRAWN); they do so only under :attr:`Stage.lock`, so no run is, say, started and
withdrawn at once. Every other move of a run has one owner at a time and takes no lock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from ax_kombu.worker.lanes import Lane
from ax_kombu.worker.run import WAITING, Run, State


class Stage:
    """The runs in this worker's pools (see the module docstring)."""

    def __init__(self) -> None:
        #: guards the moves between the waiting states and out of them
        self.lock = threading.Lock()
        #: runs handed to a pool and not settled yet (added and removed by the consuming
        #: thread; other threads read a copy: ``list(stage.runs)``)
        self.runs: set[Run[Lane]] = set()
        #: the latest trigger time of any run handed over (epoch ms): none waits for its
        #: trigger time once the clock has passed it
        self.latest_trigger = 0

    def add(self, runs: list[Run[Lane]]) -> None:
        """FENCED → STAGED for ``runs``, about to be submitted to their pools."""
        with self.lock:
            for run in runs:
                run.move(State.STAGED)
        self.runs.update(runs)
        if runs:
            self.latest_trigger = max(self.latest_trigger, max(r.task.trigger_time for r in runs))

    def discard(self, runs: Iterable[Run[Lane]]) -> None:
        """Settled runs leave the index (the consuming thread)."""
        for run in runs:
            self.runs.discard(run)

    def waiting(self) -> list[Run[Lane]]:
        """The runs staged or listed now (the caller has :attr:`lock`)."""
        return [run for run in list(self.runs) if run.state in WAITING]

    def withdraw(self) -> list[Run[Lane]]:
        """STAGED or LISTED → WITHDRAWN for every run not started yet: none of them will call
        its processor or record an outcome; the caller writes their rows back."""
        with self.lock:
            withdrawn = self.waiting()
            for run in withdrawn:
                run.move(State.WITHDRAWN)
        return withdrawn

    def begun(self) -> list[int]:
        """The task ids of the runs whose processor was called and that are not settled yet
        (their rows are RUNNING here until their outcome is written; from any thread)."""
        return [run.task.task_id for run in list(self.runs) if run.state in _BEGUN]


_BEGUN = frozenset({State.STARTED, State.ENDED, State.DURABLE})
