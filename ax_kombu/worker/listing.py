"""Listed runs: which of a worker's RUNNING tasks certainly have not started.

A worker fences its runs DISPATCHING → RUNNING in batches ahead of its threads
(:mod:`ax_kombu.worker.intake`), so a RUNNING row alone does not say whether its run
started. When the worker dies, a run that started must count a retry (FAILED when none
is left: at-least-once, bounded), and one that only waited in the stage must not: it
gets a new attempt as if it had never been sent.

**Guarantee.** A task id in the node row's ``listed_runs`` (``,id,id,``) names a run that
has not started, and will not start before a write without it has committed
(:class:`Listing`): the scan (:class:`ListingScan`) moves a staged run to LISTED, and a
pool thread that reaches a listed run has it released first (:meth:`Listing.release`, one
commit) — both under the stage's lock (:class:`~ax_kombu.worker.stage.Stage`), so no run is
listed and started at once. So a dead worker's RUNNING row whose id is among its listed
runs never started (:data:`ax_kombu.store.recovery.UNSTARTED`); every other RUNNING row
counts as started (the safe side: a run staged for less than a scan, or released and not
started yet, counts a retry if the worker dies then). A write refused because the
incarnation is no longer live (declared dead, replaced) releases nothing: those runs never
start here.

**Told, not asking.** The listing learns of runs entering LISTED (:meth:`Listing.add`),
of those its lane will reach soon (:meth:`Listing.release_soon`) and of those leaving it
without a release (:meth:`Listing.forget`: withdrawn, cancelled, abandoned); it never
reads the intake.

**Cost.** Nothing per run on the plain path: only runs that will wait are listed — those
of a lane that its threads will not reach within :data:`LIST_AFTER_S` at the lane's
measured run time (:class:`ListingScan`), looked at every :data:`SCAN_S`. A burst of short
runs lists nothing; a lane of long runs lists its stage and writes the list when it
changes; a thread that reaches a listed run waits one commit, after a wait of its own of
at least a scan.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from ax_kombu.store.engine import one_statement
from ax_kombu.store.nodes import Heartbeat
from ax_kombu.worker.lanes import Lane
from ax_kombu.worker.run import Run, State
from ax_kombu.worker.stage import Stage

log = logging.getLogger(__name__)

#: a staged run its lane's threads will not reach within this is listed (written down)
LIST_AFTER_S = 1.0
#: how often the stage is looked at for runs to list or release
SCAN_S = 0.2
#: how long a thread waits for a release before it looks at its run's signal again
WAIT_S = 0.05
#: the first wait after a failed write (doubling to 1 s)
RETRY_S = 0.05


class Listing:
    """This worker's listed runs and the thread that writes them.

    Args:
        heartbeat: the node's registration (its ``node_id`` and live ``incarnation``).
        engine: where the list is written (an engine of its own).
    """

    def __init__(self, heartbeat: Heartbeat, engine: Engine) -> None:
        self._heartbeat = heartbeat
        self._engine = engine
        self._cond = threading.Condition()
        #: listed in memory (may not start): task id -> the incarnation that fenced its run
        #: (only the live one's are written)
        self._listed: dict[int, int] = {}
        #: the ids the row lists as of the last committed write, and its incarnation
        self.written: frozenset[int] = frozenset()
        self.incarnation = 0
        #: asked to be released (a thread waits, or its lane is about to reach it)
        self._releasing: set[int] = set()
        #: the incarnation a write was refused for (its listed runs never start)
        self._refused = -1
        self._dirty = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, runs: Iterable[tuple[int, int]]) -> None:
        """``(task id, incarnation that fenced it)`` entered LISTED: written at the next
        write, if that incarnation is the live one."""
        with self._cond:
            for task_id, incarnation in runs:
                if task_id not in self._listed:
                    self._listed[task_id] = incarnation
                    self._dirty = True
            self._cond.notify_all()

    def release_soon(self, ids: Sequence[int]) -> None:
        """Listed runs their lane's threads will reach soon: released ahead of them."""
        if not ids:
            return
        with self._cond:
            self._releasing.update(t for t in ids if t in self._listed)
            self._dirty = True
            self._cond.notify_all()

    def release(self, task_id: int, incarnation: int, gone: Callable[[], bool]) -> bool:
        """Wait until the row no longer lists ``task_id`` (written under ``incarnation``):
        True, the run may start; False if the incarnation is no longer live or ``gone()``
        (withdrawn or cancelled meanwhile). Called by a pool thread that reached a listed
        run."""
        with self._cond:
            self._releasing.add(task_id)
            self._dirty = True
            self._cond.notify_all()
            while task_id in self._listed or (task_id in self.written
                                              and self.incarnation == incarnation):
                if self._refused >= incarnation or self.incarnation > incarnation or gone():
                    return False
                self._cond.wait(WAIT_S)
            return True

    def forget(self, ids: Iterable[int]) -> None:
        """Runs that left LISTED without a release (withdrawn, cancelled, abandoned: never
        starting here): no longer listed."""
        with self._cond:
            for task_id in ids:
                if self._listed.pop(task_id, None) is not None:
                    self._dirty = True
            if self._dirty:
                self._cond.notify_all()

    @property
    def any(self) -> bool:
        """Whether any run is listed (read without the lock: a hint)."""
        return bool(self._listed)

    # -- the writer ------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ax-listed-runs", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(5.0)

    def _run(self) -> None:
        delay_s = RETRY_S
        while not self._stop.is_set():
            with self._cond:
                registered = self._heartbeat.incarnation
                if registered != self.incarnation and registered > self._refused:
                    self._dirty = True  # registered anew: the row lists nothing now
                if not self._dirty:
                    self._cond.wait(SCAN_S)
                    continue
                self._dirty = False
                releasing = self._releasing & self._listed.keys()
                keep = frozenset(t for t, inc in self._listed.items()
                                 if inc == registered and t not in releasing)
            if keep == self.written and registered == self.incarnation:
                self._settle(releasing, keep, registered, True)
                continue
            try:
                with one_statement(self._engine) as conn:  # no lock outlives a cut
                    live = self._heartbeat.write_listed_runs(conn, registered, _encode(keep))
            except SQLAlchemyError:
                log.warning("listed runs not written; the runs being released wait",
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
                    self._listed.pop(task_id, None)
                self._releasing -= released
                self.written, self.incarnation = written, incarnation
            else:
                self._refused = max(self._refused, incarnation)
            self._cond.notify_all()


class ListingScan:
    """Every :data:`SCAN_S` (a step of the node): list the staged runs their lane's threads
    will not reach within :data:`LIST_AFTER_S` (after its free threads, at its measured run
    time, in the order the threads take them: :func:`_take_order`), and have the listed runs
    now within reach released early. STAGED → LISTED under the stage's lock, as a pool thread
    takes runs."""

    def __init__(self, stage: Stage, lanes: Sequence[Lane], listing: Listing) -> None:
        self._stage = stage
        self._lanes = lanes
        self._listing = listing

    def __call__(self) -> None:
        reach = {lane: lane.pool.free + lane.can_finish(LIST_AFTER_S) for lane in self._lanes
                 # a lane whose run time is not measured yet lists only behind runs that
                 # have already taken longer than the horizon
                 if lane.measured or lane.pool.running_for_s() > LIST_AFTER_S}
        crowded = {lane for lane in reach if lane.pool.staged > reach[lane]}
        if not crowded and not self._listing.any:
            return
        soon: list[int] = []
        listed: list[tuple[int, int]] = []
        with self._stage.lock:
            by_lane: dict[Lane, list[Run[Lane]]] = {}
            for run in self._stage.waiting():
                if run.lane in crowded:
                    by_lane.setdefault(run.lane, []).append(run)
                elif run.state is State.LISTED:
                    soon.append(run.task.task_id)
            for lane, waiting in by_lane.items():
                waiting.sort(key=_take_order)
                soon += [r.task.task_id for r in waiting[:reach[lane]]
                         if r.state is State.LISTED]
                for run in waiting[reach[lane]:]:
                    if run.state is State.STAGED:
                        run.move(State.LISTED)
                        listed.append((run.task.task_id, run.incarnation))
            if listed:  # under the lock: a thread that takes one of them must find it listed
                self._listing.add(listed)
        self._listing.release_soon(soon)


def _take_order(run: Run[Lane]) -> tuple[float, int]:
    """The order its pool's threads take waiting runs in (:attr:`Run.order
    <ax_kombu.worker.run.Run.order>`): the scan lists the runs at its end and releases those
    at its head, so the threads reach released runs, not listed ones. (The stage is a set:
    sorted by trigger time alone, the runs of one burst came in hash order, and the threads
    kept reaching listed runs and waiting a write each: docs/benchmarks.md, "Issue 39, fifth
    session".)"""
    return run.order


def _encode(ids: Iterable[int]) -> str:
    """``,1,2,3,``: each id between commas, so ``LIKE '%,id,%'`` finds exactly it."""
    return "," + "".join(f"{task_id}," for task_id in ids)
