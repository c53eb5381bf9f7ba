"""The ax side of one Celery worker's runs: the start fence, and where each end goes.

Used by :class:`ax_kombu.celery.AxBootstep`; the node itself (registration, beats, lease,
the shared incarnation) is :mod:`ax_kombu.celery.node`, the ends :mod:`ax_kombu.celery.ends`.
Contracts:

* **Every start is fenced by the live incarnation**: the RUNNING move is one
  compare-and-set on ``(task_id, attempt)`` *and* on this node's live incarnation
  (:func:`ax_kombu.store.transitions.start_many`), so a worker declared dead starts nothing
  until it has registered again. A start refused because the node is not live waits (up to
  the silence window) for the next incarnation and tries once more; else the message is
  refused (ax's ack timeout dispatches the task again).
* **Fenced ahead**: a message published ahead of its due instant (Celery's ``eta``) has
  its RUNNING move written when the worker's main process receives it (:meth:`Fence.
  prefence`), in batches, by a thread of its own, fenced as above; at the due instant the
  run checks that it may start without a write: in the process that moved it (a thread
  pool) by its :class:`~ax_kombu.core.lease.Lease` (its beats prove the incarnation live;
  each beat also drops the moved runs whose task was cancelled since), in a prefork child
  by one read of the row and the node (:meth:`Fence.fenced_ahead`). A commit's latency is
  paid up to a second early, not at the start. A message whose move was not written ahead
  (late, or the move failed) is moved at the start, as before. A worker that dies between
  the two has the task counted as run ("worker lost", retried): its RUNNING row cannot
  tell.
* **Never early**: a run whose trigger time is still ahead on the database clock (its
  message carried Celery's ``eta`` and the worker's clock is ahead) waits for it after the
  RUNNING move, which writes the trigger time as ``started_at``.
* **Every end is recorded once**, fenced by attempt: SUCCESS, a retry with ax's backoff or
  FAILED (:meth:`Fence.finish`); a run whose process died (a prefork child killed by the OOM
  killer or a hard time limit) as "worker lost", retried or FAILED per ``max_retry``
  (:meth:`Fence.lose`); a revoked one CANCELLED (:meth:`Fence.cancel`). The last two are
  written by the main process, which outlives the child.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any, Literal

from sqlalchemy import bindparam, exists, select

from ax_kombu.celery import ends as celery_ends
from ax_kombu.celery.ends import End, EndWriter
from ax_kombu.celery.node import POLL_S, CeleryNode, ProcessStore, SharedIncarnation
from ax_kombu.config import Settings
from ax_kombu.core.lease import Lease
from ax_kombu.core.states import Status
from ax_kombu.store import Store
from ax_kombu.store import gates as gate_store
from ax_kombu.store.schema import nodes, tasks
from ax_kombu.store.tasks import cancelled_among
from ax_kombu.store.transitions import Started, transition
from ax_kombu.store.transitions import start_many as start_rows

log = logging.getLogger(__name__)
#: the most RUNNING moves one statement of the fencing-ahead thread makes
_AHEAD_BATCH = 500
#: how long a start waits for its move being written ahead in this process
_AHEAD_WAIT_S = 1.0
#: how long a run moved ahead is remembered for its start in this process (it is due
#: within about a second of the move)
_FENCED_KEEP_S = 60.0
#: how long the fencing-ahead thread gathers messages into one statement (they arrive
#: well before they are due: a few milliseconds cost nothing, while a statement per
#: message costs the worker's main process the GIL it needs to receive them)
_AHEAD_GATHER_S = 0.01

#: a row RUNNING at an attempt on a node (Fence.running_here)
_RUNNING_HERE = (
    select(*[tasks.c[name] for name in Started._fields])
    .where(tasks.c.task_id == bindparam("id"), tasks.c.attempt == bindparam("att"),
           tasks.c.status == Status.RUNNING.value, tasks.c.owner_node == bindparam("node")))
#: ... and the node's incarnation is the live one (Fence.fenced_ahead)
_FENCED_AHEAD = _RUNNING_HERE.where(
    exists().where(nodes.c.node_id == bindparam("node"), nodes.c.incarnation == bindparam("inc"),
                   nodes.c.stopped_at.is_(None)))

__all__ = ["End", "Fence", "SharedIncarnation"]


class Fence:
    """The ax side of one Celery worker (see the module docstring).

    Safe in every pool: each process (prefork children included) opens its own store
    on first use; :meth:`register` and the heartbeat belong to the main process, the one
    that made this object (before the pool forks).

    Args:
        settings: ax's settings (``AX_*``).
        node_id: the ax node name of the worker.
        running: the ax task ids this process runs now (kept RUNNING by a re-registration).
        pool_size: database connections kept open per process (the worker's concurrency
            and its own threads); default: the store's.
    """

    def __init__(self, settings: Settings, node_id: str,
                 running: Callable[[], Collection[int]] = tuple,
                 pool_size: int | None = None) -> None:
        self.settings = settings
        self.node_id = node_id
        self._stores = ProcessStore(settings, pool_size)
        self.node = CeleryNode(settings, node_id, self._stores, running,
                               on_registered=self._forget_fenced,
                               on_beat=self._drop_cancelled)
        self._lock = threading.Lock()
        self._writer: EndWriter | None = None
        #: moves being written ahead in this process (the start waits for them)
        self._ahead: dict[tuple[int, int], threading.Event] = {}
        #: moved ahead by this process, not started yet: the row as the move returned it,
        #: the incarnation it was moved under, and when (monotonic); kept only when the
        #: runs start in this process (a thread pool: see runs_here)
        self._fenced: dict[tuple[int, int], tuple[Started, int, float]] = {}
        #: the runs start in this process (threads, solo, gevent), not in forked children
        self.runs_here = True
        self._ahead_queue: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
        self._ahead_thread: threading.Thread | None = None

    @property
    def store(self) -> Store:
        """The store of the calling process."""
        return self._stores.get()

    @property
    def incarnation(self) -> SharedIncarnation:
        return self.node.incarnation

    @property
    def lease(self) -> Lease:
        return self.node.lease

    # -- the node -------------------------------------------------------------------------

    def register(self, queues: list[str]) -> None:
        """Become an ax node and heartbeat (on a daemon thread) until the process exits."""
        self.node.register(queues)

    def unregister(self) -> None:
        """Stop beating and mark the node stopped (a clean exit: nothing runs any more)."""
        self.node.unregister()

    def in_pool_child(self) -> bool:
        """Whether this is a pool process forked by the registered main process (prefork)."""
        return self.node.in_pool_child()

    def _forget_fenced(self) -> None:
        """Registered anew: what was moved ahead under the incarnation this one recovers
        from is read from the row at its start (and refused)."""
        self._fenced.clear()

    # -- the starts -----------------------------------------------------------------------

    def prefence(self, task_id: int, attempt: int) -> None:
        """A message due later has arrived (the main process): write its RUNNING move
        now, with the others arriving, on the fencing-ahead thread (module docstring)."""
        key = (task_id, attempt)
        with self._lock:
            if self._ahead_thread is None or not self._ahead_thread.is_alive():
                self._ahead_thread = threading.Thread(target=self._fence_ahead,
                                                      name="ax-celery-fence-ahead", daemon=True)
                self._ahead_thread.start()
            self._ahead.setdefault(key, threading.Event())
        self._ahead_queue.put(key)

    def _fence_ahead(self) -> None:
        while True:
            batch = [self._ahead_queue.get()]
            gathered = time.monotonic() + _AHEAD_GATHER_S  # what arrives meanwhile goes too
            while len(batch) < _AHEAD_BATCH and (left := gathered - time.monotonic()) > 0:
                try:
                    batch.append(self._ahead_queue.get(timeout=left))
                except queue.Empty:
                    break
            try:
                self._move_ahead(batch)
            except Exception:  # the store failed: each run moves its row at its start
                log.warning("ax: could not fence Celery runs ahead; they are fenced at start",
                            exc_info=True, extra={"node": self.node_id})
            finally:
                with self._lock:
                    for key in batch:
                        event = self._ahead.pop(key, None)
                        if event is not None:
                            event.set()

    def _move_ahead(self, batch: list[tuple[int, int]]) -> None:
        """One RUNNING move for ``batch``, under the incarnation live now."""
        incarnation, attempts = self.incarnation.get(), dict(batch)
        with self._stores.one_statement() as conn:
            moved = start_rows(conn, batch, self.node_id, self.store.now_ms(),
                               incarnation=incarnation)
        if self.runs_here:
            at = time.monotonic()
            for row in moved:
                self._fenced[(row.task_id, attempts[row.task_id])] = (row, incarnation, at)

    def fenced_ahead(self, task_id: int, attempt: int, incarnation: int) -> Started | None:
        """The row, if it was moved RUNNING at ``attempt`` on this node (ahead) and
        ``incarnation`` is still this node's live one: one read (a statement built once,
        in autocommit: no transaction to end), no write."""
        with self._stores.one_statement() as conn:
            row = conn.execute(_FENCED_AHEAD, {"id": task_id, "att": attempt,
                                               "node": self.node_id, "inc": incarnation}).first()
        return _started(row)

    def start(self, task_id: int, attempt: int, ahead: bool = False) -> Started | None:
        """DISPATCHING → RUNNING for this attempt under the live incarnation, then wait
        for the trigger time if it is still ahead; None if the row is not at this attempt
        or no live incarnation took it (refuse the message). ``ahead``: the message was
        published ahead of its due instant, so its move may have been written already
        (:meth:`prefence`)."""
        started = self._started_ahead(task_id, attempt) if ahead else None
        if started is False:
            return None  # moved under an incarnation declared dead since
        if started is None:
            started = self._start_now(task_id, attempt, ahead)
        if started is not None:
            self._wait_until(started.trigger_time)
        return started

    def _started_ahead(self, task_id: int, attempt: int) -> Started | Literal[False] | None:
        """The row moved ahead for this attempt, if its start may go on; False if it must
        be refused; None if no move ahead decides it."""
        key = (task_id, attempt)
        event = self._ahead.get(key)
        if event is not None:
            event.wait(_AHEAD_WAIT_S)
        fenced = self._fenced.pop(key, None)
        if fenced is not None:  # moved by this process: its lease decides, no round trip
            covered = self._covered(fenced[1])
            if covered is not None:
                return fenced[0] if covered else False
        return self.fenced_ahead(task_id, attempt, self.incarnation.get())

    def _start_now(self, task_id: int, attempt: int, ahead: bool) -> Started | None:
        incarnation = self.incarnation.get()
        started = self._start(task_id, attempt, incarnation)
        if started is None and ahead:  # moved ahead by the main process meanwhile
            started = self.fenced_ahead(task_id, attempt, incarnation)
        if started is None and not self.node.live(incarnation):
            newer = self.node.next_incarnation(incarnation)
            if newer is not None:
                started = self._start(task_id, attempt, newer)
        return started

    def _covered(self, incarnation: int) -> bool | None:
        """Whether this process may start what it moved under ``incarnation`` (its
        :class:`~ax_kombu.core.lease.Lease`), waiting up to the silence window while its
        beats are not confirmed; None if still undecided then."""
        deadline = time.monotonic() + self.settings.silence_ms / 1000.0
        while (covered := self.lease.covers(incarnation)) is None:
            if time.monotonic() >= deadline:
                return None
            self.lease.wait(incarnation, POLL_S)
        return covered

    def _drop_cancelled(self) -> None:
        """Forget the runs moved ahead whose task was cancelled since (``ax cancel``): their
        start reads the row, and refuses the message; and those moved over a minute ago that
        never started here (revoked in Celery, say: a start would read the row)."""
        stale = time.monotonic() - _FENCED_KEEP_S
        for key, (_, _, at) in list(self._fenced.items()):
            if at < stale:
                self._fenced.pop(key, None)
        keys = list(self._fenced)
        if not keys:
            return
        with self.store.engine.connect() as conn:
            gone = set(cancelled_among(conn, [task_id for task_id, _ in keys]))
        for key in keys:
            if key[0] in gone:
                self._fenced.pop(key, None)

    def _start(self, task_id: int, attempt: int, incarnation: int) -> Started | None:
        with self._stores.one_statement() as conn:
            rows = start_rows(conn, [(task_id, attempt)], self.node_id, self.store.now_ms(),
                              incarnation=incarnation)
        return rows[0] if rows else None

    def _wait_until(self, trigger_ms: int) -> None:
        """Sleep until ``trigger_ms`` on the database clock (a run never starts early)."""
        wait_ms = trigger_ms - self.store.now_ms()  # measures the clock when due (a child)
        if wait_ms > 0:
            time.sleep(wait_ms / 1000)

    # -- the ends -------------------------------------------------------------------------

    def end_of(self, task: Started, attempt: int, error: str | None,
               result: str | None = None, *, outcome: str = "RETRY") -> End:
        """The end of a run started by :meth:`start` (:func:`ax_kombu.celery.ends.end_of`)."""
        return celery_ends.end_of(task, attempt, error, result, self.store.now_ms(),
                                  self.settings, outcome=outcome)

    def finish(self, task: Started, attempt: int, error: str | None,
               result: str | None = None, *, outcome: str = "RETRY") -> bool:
        """Record the end of a run started by :meth:`start` now; returns whether the row
        moved (fenced by attempt)."""
        return bool(self.record([self.end_of(task, attempt, error, result, outcome=outcome)]))

    def finish_soon(self, task: Started, attempt: int, error: str | None,
                    result: str | None = None) -> None:
        """As :meth:`finish`, written by the process's :class:`~ax_kombu.celery.ends.
        EndWriter` (with the ends of other runs) when this is the main process."""
        end = self.end_of(task, attempt, error, result)
        if self.in_pool_child():
            self.record([end])
            return
        with self._lock:
            if self._writer is None:
                self._writer = EndWriter(self.record)
                atexit.register(self.flush, 10.0)
            writer = self._writer
        writer.put(end)

    def flush(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until the ends :meth:`finish_soon` took are written."""
        writer = self._writer
        return writer is None or writer.flush(timeout_s)

    def record(self, ends: Sequence[End]) -> list[int]:
        """Write ``ends`` (:func:`ax_kombu.celery.ends.record`); returns the ids that moved."""
        return celery_ends.record(self._stores, self.node_id, ends)

    def running_here(self, task_id: int, attempt: int) -> Started | None:
        """The row of ``task_id`` if it is RUNNING at ``attempt`` on this node (as
        :meth:`start` returned it), else None."""
        with self.store.engine.connect() as conn:
            row = conn.execute(_RUNNING_HERE, {"id": task_id, "att": attempt,
                                               "node": self.node_id}).first()
        return _started(row)

    def lose(self, task_id: int, attempt: int, why: str) -> bool:
        """A run whose process died before it recorded its end: retried (ax's backoff) or
        FAILED per ``max_retry``, with ``why``; returns whether the row moved (a run that
        recorded its own end, or is no longer this attempt on this node, does not)."""
        task = self.running_here(task_id, attempt)
        return task is not None and self.finish(task, attempt, f"worker lost: {why}",
                                                outcome="LOST")

    def cancel(self, task_id: int, attempt: int, why: str) -> bool:
        """A run revoked in Celery (before or while it ran): CANCELLED at this attempt, with
        ``why``; returns whether the row moved."""
        self._fenced.pop((task_id, attempt), None)
        store = self.store
        now = store.now_ms()
        with store.engine.begin() as conn:
            row = conn.execute(select(tasks.c.task_type, tasks.c.gated, tasks.c.order_key)
                               .where(tasks.c.task_id == task_id)).first()
            moved = transition(conn, [task_id], [Status.DISPATCHING, Status.RUNNING],
                               Status.CANCELLED, attempt=attempt,
                               values={"finished_at": now, "last_error": why[:2000]})
            if moved and row is not None and row.gated:
                gate_store.wake_next(conn, [(row.task_type, row.order_key)])
        return bool(moved)


def _started(row: Any) -> Started | None:
    """A row read with ``Started``'s columns as a :class:`Started` (None for no row)."""
    return None if row is None else Started(**{**row._asdict(), "gated": bool(row.gated)})
