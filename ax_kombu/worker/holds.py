"""Held runs: which of a worker's RUNNING tasks certainly have not started.

A worker fences its runs DISPATCHING → RUNNING in batches ahead of its threads
(:mod:`ax_kombu.worker.intake`), so a RUNNING row alone does not say whether its run
started. When the worker dies, a run that started must count a retry (FAILED when none
is left: at-least-once, bounded), and one that was only held in the stage must not: it
gets a new attempt as if it had never been sent.

**Guarantee.** A task id in the node row's ``held_runs`` (``,id,id,``) names a run that
has not started, and will not start before a write without it has committed
(:class:`Holds`): the intake flags a staged run held, and a pool thread that reaches a
flagged run first has it released (:meth:`Holds.release`, one commit) — both under the
intake's lock, so no run is flagged and started at once. So a dead worker's RUNNING row
whose id is among its held runs never started (:data:`ax_kombu.store.recovery.UNSTARTED`);
every other RUNNING row counts as started (the safe side: a run staged for less than a
scan, or released and not started yet, counts a retry if the worker dies then). A write
refused because the incarnation is no longer live (declared dead, replaced) releases
nothing: those runs never start here.

**Cost.** Nothing per run on the plain path: only runs that will wait are held — those of
a lane that its threads will not reach within :data:`HOLD_AFTER_S` at the lane's measured
run time (:meth:`~ax_kombu.worker.intake.Intake.holdable`), looked at every
:data:`SCAN_S`. A burst of short runs holds nothing; a lane of long runs holds its stage
and writes the list when it changes; a thread that reaches a held run waits one commit,
after a wait of its own of at least a scan.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from ax_kombu.store.nodes import Heartbeat

log = logging.getLogger(__name__)

#: a staged run its lane's threads will not reach within this is held (written down)
HOLD_AFTER_S = 1.0
#: how often the stage is looked at for runs to hold or release
SCAN_S = 0.2
#: how long a thread waits for a release before it looks at its run's signal again
WAIT_S = 0.05
#: the first wait after a failed write (doubling to 1 s)
RETRY_S = 0.05


class Holds:
    """This worker's held runs and the thread that writes them.

    Args:
        heartbeat: the node's registration (its ``node_id`` and live ``incarnation``).
        engine: where the list is written (an engine of its own).
        scan: called every :data:`SCAN_S` on the writer's thread: it flags the staged
            runs to hold (calling :meth:`hold` under the intake's lock) and returns the
            held runs to release early (their lane's threads will reach them soon) — see
            :meth:`ax_kombu.worker.intake.Intake.holdable`.
    """

    def __init__(self, heartbeat: Heartbeat, engine: Engine,
                 scan: Callable[[], list[int]] | None = None) -> None:
        self._heartbeat = heartbeat
        self._engine = engine
        self.scan = scan
        self._cond = threading.Condition()
        #: flagged held in memory (may not start), and the ids the row holds as of the
        #: last committed write, with the incarnation it was written under
        #: task id -> the incarnation that fenced its run (only the live one's are written)
        self._held: dict[int, int] = {}
        self.written: frozenset[int] = frozenset()
        self.incarnation = 0
        #: asked to be released (a thread waits, or its lane is about to reach it)
        self._releasing: set[int] = set()
        #: the incarnation a write was refused for (its held runs never start)
        self._refused = -1
        self._dirty = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def hold(self, runs: Iterable[tuple[int, int]]) -> None:
        """``(task id, incarnation that fenced it)`` flagged held (the caller holds the
        intake's lock): written at the next write, if that incarnation is the live one."""
        with self._cond:
            for task_id, incarnation in runs:
                if task_id not in self._held:
                    self._held[task_id] = incarnation
                    self._dirty = True

    def release(self, task_id: int, incarnation: int, gone: Callable[[], bool]) -> bool:
        """Wait until the row no longer holds ``task_id`` (written under ``incarnation``):
        True, the run may start; False if the incarnation is no longer live or ``gone()``
        (withdrawn or cancelled meanwhile). Called by a pool thread that reached a held
        run."""
        with self._cond:
            self._releasing.add(task_id)
            self._dirty = True
            self._cond.notify_all()
            while task_id in self._held or (task_id in self.written
                                            and self.incarnation == incarnation):
                if self._refused >= incarnation or self.incarnation > incarnation or gone():
                    return False
                self._cond.wait(WAIT_S)
            return True

    def forget(self, ids: Iterable[int]) -> None:
        """Withdrawn or cancelled while held (never starting here): no longer held."""
        with self._cond:
            for task_id in ids:
                if self._held.pop(task_id, None) is not None:
                    self._dirty = True

    @property
    def holding(self) -> bool:
        """Whether any run is flagged held (read without the lock: a hint)."""
        return bool(self._held)

    # -- the writer ------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ax-held-runs", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(5.0)

    def _run(self) -> None:
        delay_s = RETRY_S
        next_scan = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if self.scan is not None and now >= next_scan:
                next_scan = now + SCAN_S
                soon = self.scan()
                with self._cond:
                    self._releasing.update(t for t in soon if t in self._held)
                    self._dirty = self._dirty or bool(soon)
            with self._cond:
                registered = self._heartbeat.incarnation
                if registered != self.incarnation and registered > self._refused:
                    self._dirty = True  # registered anew: the row holds nothing now
                if not self._dirty:
                    self._cond.wait(max(0.001, next_scan - time.monotonic()))
                    continue
                self._dirty = False
                releasing = self._releasing & self._held.keys()
                keep = frozenset(t for t, inc in self._held.items()
                                 if inc == registered and t not in releasing)
            if keep == self.written and registered == self.incarnation:
                self._settle(releasing, keep, registered, True)
                continue
            try:
                with self._engine.begin() as conn:
                    live = self._heartbeat.write_listed_runs(conn, registered, _encode(keep))
            except SQLAlchemyError:
                log.warning("held runs not written; the runs being released wait",
                            exc_info=True, extra={"node": self._heartbeat.node_id})
                with self._cond:
                    self._dirty = True
                self._stop.wait(delay_s)
                delay_s = min(1.0, delay_s * 2)
                continue
            delay_s = RETRY_S
            self._settle(releasing, keep, registered, live)

    def _settle(self, released: set[int], written: frozenset[int], incarnation: int,
                live: bool) -> None:
        with self._cond:
            if live:
                for task_id in released:
                    self._held.pop(task_id, None)
                self._releasing -= released
                self.written, self.incarnation = written, incarnation
            else:
                self._refused = max(self._refused, incarnation)
            self._cond.notify_all()


def _encode(ids: Iterable[int]) -> str:
    """``,1,2,3,``: each id between commas, so ``LIKE '%,id,%'`` finds exactly it."""
    return "," + "".join(f"{task_id}," for task_id in ids)
