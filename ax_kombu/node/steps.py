"""Start and stop as data: a daemon is a list of named steps.

A :class:`Step` has a ``name``, ``start()`` and ``stop()``. A :class:`Blueprint` starts its
steps in the order listed and stops the ones it started in the reverse order, logging each,
so a daemon's order is read in one list: a step stops after every step listed after it
(one that needs another running until it stops is listed before it). A step whose
``stop()`` raises is logged and the others still stop.

:class:`Timers` is a step that runs small periodic jobs on one thread of its own, each
every its own interval, so that a thread such as the heartbeat's does one job.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

log = logging.getLogger(__name__)


class Step(Protocol):
    """A part of a daemon with a start and a stop."""

    @property
    def name(self) -> str: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...


def _nothing() -> None:
    """A step's start or stop that has nothing to do."""


class Call:
    """A step made of two functions (either may do nothing)."""

    def __init__(self, name: str, start: Callable[[], None] = _nothing,
                 stop: Callable[[], None] = _nothing) -> None:
        self.name = name
        self._start = start
        self._stop = stop

    def start(self) -> None:
        self._start()

    def stop(self) -> None:
        self._stop()

    def __repr__(self) -> str:
        return f"Call({self.name!r})"


class Blueprint:
    """Starts steps in order and stops the started ones in reverse (module docstring).

    Args:
        name: the daemon's, for the log.
    """

    def __init__(self, name: str, steps: Sequence[Step]) -> None:
        self.name = name
        self.steps = list(steps)
        self._started: list[Step] = []

    def start(self) -> None:
        """Start every step in order. If one raises, the steps started so far are stopped
        (in reverse) and the error is raised."""
        for step in self.steps:
            log.debug("starting step", extra={"daemon": self.name, "step": step.name})
            try:
                step.start()
            except BaseException:
                self.stop()
                raise
            self._started.append(step)

    def stop(self) -> None:
        """Stop the started steps in reverse order, each once; one that raises is logged."""
        while self._started:
            step = self._started.pop()
            log.debug("stopping step", extra={"daemon": self.name, "step": step.name})
            try:
                step.stop()
            except Exception:
                log.exception("a step failed to stop", extra={"daemon": self.name,
                                                               "step": step.name})


class Job(NamedTuple):
    """A periodic job of :class:`Timers`: ``run`` every ``every_s`` seconds; a tolerated
    error is logged at ``level`` (a job that runs every few milliseconds logs quietly)."""

    name: str
    every_s: float
    run: Callable[[], object]
    level: int = logging.WARNING


class Timers:
    """A step: one thread running periodic jobs, each at its own interval (the first run one
    interval after the start), until stopped.

    Args:
        tolerated: errors a job may raise and be run again at its next time (logged at
            the job's ``level``); anything else ends the thread (a supervised daemon stops).
        final: run once more on the stopping thread after the timer thread ended (e.g. a
            last write of what a job collects).
    """

    def __init__(self, name: str, jobs: Sequence[Job], *,
                 tolerated: tuple[type[BaseException], ...] = (),
                 final: Callable[[], None] = _nothing) -> None:
        self.name = name
        self.jobs = list(jobs)
        self._tolerated = tolerated
        self._final = final
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"ax-{self.name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(5.0)
        self._final()

    def _run(self) -> None:
        now = time.monotonic()
        due = [now + job.every_s for job in self.jobs]
        while True:
            wait = max(0.0, min(due) - time.monotonic())
            if self._stopped.wait(wait):
                return
            now = time.monotonic()
            for index, job in enumerate(self.jobs):
                if due[index] <= now:
                    due[index] = now + job.every_s
                    self._call(job)

    def _call(self, job: Job) -> None:
        try:
            job.run()
        except self._tolerated:
            log.log(job.level, "a periodic job failed; it runs again at its next time",
                    exc_info=True, extra={"step": self.name, "job": job.name})
