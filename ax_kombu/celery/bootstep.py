"""The optional worker extension: :class:`AxBootstep` fences and records Celery runs in ax.

Enabled with one line where the Celery app is made::

    app.steps["worker"].add(ax_kombu.celery.AxBootstep)

With it, a Celery worker takes part in ax as an ax-worker does, for the Celery-bound
tasks it receives (those carrying the ``ax_task_id`` and ``ax_attempt`` headers):

* **Staged and fenced ahead, checked at the due instant**: ax publishes such a task up
  to 1 s (:data:`ax_kombu.core.runners.CELERY_AX_LEAD_MS`) before it is due, with Celery's
  own ``eta`` header, so the Celery worker's timer keeps it until the due instant
  (:mod:`ax_kombu.broker.celery_wire`). When the message arrives (``task_received``, in
  the main process) the row moves DISPATCHING → RUNNING by compare-and-set on
  ``(task_id, attempt)`` and on this worker's live ax incarnation, with ``owner_node`` =
  this worker's ax node, in batches on a thread of its own; when it runs, before the task
  body, a read checks that the row is still RUNNING at that attempt here and the
  incarnation still live (a message that arrived late is moved then, as one statement)
  (:mod:`ax_kombu.celery.fence`). A message whose attempt is not the
  row's (stale, duplicated, cancelled meanwhile) or that no live incarnation may start is
  refused: Celery's ``Ignore`` — acked, the body never runs.
* **Recorded end**: SUCCESS after the body returns; after an exception, FAILED when no
  ax retries remain, else DELAYED with ax's backoff (ax dispatches a new attempt, under a
  new Celery id). In the worker's main process the ends are written in batches by one
  thread (:mod:`ax_kombu.celery.ends`), flushed when the step stops; a prefork child
  writes its own. Any ``BaseException`` too (``SystemExit``, a greenlet killed by
  ``revoke(terminate=True)``): CANCELLED when Celery revoked the task, else as a failure;
  in a prefork child (where ``revoke(terminate=True)``'s SIGTERM becomes ``SystemExit``)
  the main process records it, which knows whether Celery revoked the task.
  A Celery retry (``self.retry()``, ``autoretry_for``) is Celery's own: the ax attempt ends
  SUCCESS as handed to Celery (``result.celery_retry``), and the retried message
  (``retries`` > 0) runs unfenced.
* **A dead pool process**: when a prefork child dies mid-run (SIGKILL, the OOM killer, a
  hard time limit), Celery's main process reports it (``task_failure`` with
  ``WorkerLostError`` or ``TimeLimitExceeded``); the step then records the run as "worker
  lost", retried or FAILED per ``max_retry``, at once — not when the whole worker dies. A
  ``revoke(terminate=True)`` (``task_revoked``, the child killed by the signal) ends the row
  CANCELLED, as does a revoke of a message not started yet. These writes are made by the
  main process, on a thread of their own, retried until the store takes them.
* **Liveness**: the worker registers as an ax node (``celery@<hostname>``) and heartbeats,
  so when it dies, ax's scheduler retries its RUNNING tasks within the recovery window
  (not after a broker visibility timeout), and a Celery-bound task no worker started
  within the ack timeout is dispatched again (its old message is then refused).

How it hooks in: at construction (before the pool starts) it wraps ``__call__`` of every
registered task class, which Celery's tracer then calls instead of ``run`` (the tracer
has pushed the request already, so the wrapper calls ``run`` itself, or the class's own
``__call__`` if it had one); a call outside a worker (``called_directly``) passes through.

The producer must mark such tasks as fenced: :func:`ax_kombu.celery.enqueue` and
:func:`ax_kombu.celery.install` do when the app has this step (or with ``fenced=True``);
the scheduler then records no hand-off for them. Settings: the ``AX_*`` variables
(``AX_DATABASE_URL`` for the store, ``AX_HEARTBEAT_INTERVAL_S``, the retry backoff).
Execution stays at-least-once: a worker that dies mid-run has its task run again.

Caveat: the ack timeout (``AX_ACK_TIMEOUT_MS``, doubling per re-dispatch) covers the time
from the publish (up to 1 s before the task is due) to the start, so also the
time a message waits in a backlogged Celery queue or a worker's prefetch; set it above that
wait, or ax re-dispatches (the old message is refused when its turn comes) and, after
``AX_MAX_DISPATCHES``, fails the task.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from celery import bootsteps, signals
from celery.app.trace import task_has_custom
from celery.exceptions import Ignore, Retry, TimeLimitExceeded
from celery.worker import state as worker_state

from ax_kombu.broker.celery_wire import celery_task_id
from ax_kombu.celery.fence import Fence
from ax_kombu.config import from_env

log = logging.getLogger(__name__)
_MARK = "__ax_fenced__"
#: the longest pause between two tries of a main-process record (a store outage)
_RECORD_BACKOFF_MAX_S = 5.0
#: how long the step's stop waits for the ends of runs to be written
FLUSH_S = 10.0
#: a message due at least this far ahead has its RUNNING move written as it arrives
AHEAD_MIN_S = 0.05

__all__ = ["AxBootstep", "Fence", "fence_tasks", "fenced_call"]


def _ax_ids(request: Any) -> tuple[int, int] | None:
    """``(ax task id, attempt)`` of a Celery request or context, if it is ax's."""
    if request is None:
        return None
    get = request.get if hasattr(request, "get") else lambda key: getattr(request, key, None)
    ax_id, attempt = get("ax_task_id"), get("ax_attempt")
    if ax_id is None or attempt is None or get("retries"):
        return None
    return int(ax_id), int(attempt)


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:2000]


def fenced_call(fence_of: Callable[[], Fence | None], original: Callable[..., Any] | None
                ) -> Callable[..., Any]:
    """The ``__call__`` installed on a task class (see the module docstring)."""
    from celery.app.task import Task

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        if request.called_directly:
            return (original or Task.__call__)(self, *args, **kwargs)

        def body() -> Any:
            return original(self, *args, **kwargs) if original else self.run(*args, **kwargs)

        fence, ids = fence_of(), _ax_ids(request)
        if fence is None or ids is None:
            return body()
        ax_id, attempt = ids
        started = fence.start(ax_id, attempt, ahead=request.eta is not None)
        if started is None:
            log.info("stale or duplicate ax message refused",
                     extra={"task_id": ax_id, "attempt": attempt, "celery_id": request.id})
            raise Ignore()
        try:
            value = body()
        except Retry:
            fence.finish(started, attempt, None, json.dumps(
                {"celery_task_id": celery_task_id(ax_id, attempt), "celery_retry": True}))
            raise
        except Exception as exc:
            fence.finish_soon(started, attempt, _error(exc))
            raise
        except BaseException as exc:  # SystemExit, a killed greenlet, …: never left RUNNING
            if fence.in_pool_child():  # its main process records it (AxBootstep._on_*)
                raise
            if request.id in worker_state.revoked:
                fence.cancel(ax_id, attempt, f"revoked in Celery ({_error(exc)})")
            else:
                fence.finish(started, attempt, _error(exc))
            raise
        fence.finish_soon(started, attempt, None, _json_or_none(value))
        return value

    setattr(__call__, _MARK, True)
    return __call__


def _json_or_none(value: Any) -> str | None:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        return None
    return text if len(text) <= 65536 else None


def fence_tasks(app: Any, fence_of: Callable[[], Fence | None]) -> int:
    """Wrap ``__call__`` of every task class of ``app`` (Celery's own ``celery.*`` left
    alone); returns how many. Idempotent."""
    wrapped = 0
    for name, task in app.tasks.items():
        cls = type(task)
        if name.startswith("celery.") or getattr(cls.__call__, _MARK, False):
            continue
        original = cls.__call__ if task_has_custom(task, "__call__") else None
        cls.__call__ = fenced_call(fence_of, original)
        task.__trace__ = None  # rebuilt: the tracer now calls the task, not run
        wrapped += 1
    return wrapped


def _active_ax_ids() -> list[int]:
    """The ax task ids of the requests this worker runs now (Celery's own bookkeeping)."""
    found = (_ax_ids(getattr(r, "request_dict", None)) for r in list(worker_state.active_requests))
    return [ids[0] for ids in found if ids is not None]


class Recorder:
    """The main process's writes for runs that could not record their own end (their pool
    process died, or Celery revoked them): on one daemon thread, each retried with a
    doubling pause until the store takes it, so a signal handler never waits for the
    database."""

    def __init__(self, fence: Fence) -> None:
        self.fence = fence
        self._queue: queue.Queue[Callable[[], Any]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def put(self, write: Callable[[], Any]) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="ax-celery-recorder",
                                                daemon=True)
                self._thread.start()
        self._queue.put(write)

    def _run(self) -> None:
        while True:
            write = self._queue.get()
            pause = 0.1
            while True:
                try:
                    write()
                    break
                except Exception:  # the store is unreachable: the row waits RUNNING
                    log.warning("could not record a Celery run's end in ax; trying again",
                                exc_info=True, extra={"node": self.fence.node_id})
                    time.sleep(pause)
                    pause = min(pause * 2, _RECORD_BACKOFF_MAX_S)


class AxBootstep(bootsteps.StartStopStep):  # type: ignore[misc]  # Celery is untyped
    """A Celery worker step: fence and record ax's Celery-bound runs (module docstring)."""

    #: at start, move what the worker has made so far (Celery, the app, SQLAlchemy) out of
    #: the collector's generations (``gc.freeze``): a full collection over them stalled a
    #: busy worker, and the tasks due meanwhile started that late; and collect the oldest
    #: generation at every collection of the middle one (its third threshold 1, was 10):
    #: Celery's ETA path leaves objects in reference cycles for each task (its Request, the
    #: kombu Message, the timer Entry, vine promises), which live until the ETA and so reach
    #: the oldest generation; collected every tenth time, they piled up into one long pause
    #: that the tasks due meanwhile waited out. Smaller, more frequent collections spread
    #: that cost (docs/benchmarks.md, "Issue 22: Celery countdowns through ax"). A subclass
    #: sets it False to leave the collector alone.
    freeze_gc = True

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        threads = getattr(worker, "concurrency", None) or 0
        self.fence = Fence(from_env(), f"celery@{worker.hostname}", running=_active_ax_ids,
                           pool_size=threads + 4 if threads else None)  # + its own threads
        self.recorder = Recorder(self.fence)
        # a prefork pool runs tasks in children, which cannot see what this process moved
        self.fence.runs_here = not _forks(getattr(worker, "pool_cls", None))
        self._main_pid = os.getpid()
        self._app = worker.app
        fence_tasks(worker.app, lambda: self.fence)
        uid = f"ax-bootstep-{id(self)}"
        signals.task_failure.connect(self._on_failure, weak=False, dispatch_uid=uid)
        signals.task_received.connect(self._on_received, weak=False, dispatch_uid=uid)
        signals.task_revoked.connect(self._on_revoked, weak=False, dispatch_uid=uid)

    def start(self, worker: Any) -> None:
        queues = sorted(q.name for q in worker.app.amqp.queues.consume_from.values())
        self.fence.register(queues)
        if self.freeze_gc:
            gc.collect()
            gc.freeze()
            young, middle, _ = gc.get_threshold()
            gc.set_threshold(young, middle, 1)
        log.info("ax fencing Celery runs", extra={"node": self.fence.node_id,
                                                  "starts_in_this_process": self.fence.runs_here})

    def stop(self, worker: Any) -> None:
        """Write the ends still waiting (the pool has stopped: no run ends after this)."""
        if not self.fence.flush(FLUSH_S):
            log.warning("ax: ends of Celery runs not written at stop; recovery retries them",
                        extra={"node": self.fence.node_id})

    def _ours(self, sender: Any) -> bool:
        """A signal of this worker's main process about one of its app's tasks."""
        return os.getpid() == self._main_pid and getattr(sender, "app", None) is self._app

    def _on_received(self, sender: Any = None, request: Any = None, **_: Any) -> None:
        """An ax message due later arrived (main process, consumer thread): its RUNNING
        move is written ahead, so the run at the due instant only reads it
        (:meth:`~ax_kombu.celery.fence.Fence.prefence`)."""
        if os.getpid() != self._main_pid or request is None:
            return
        if getattr(getattr(request, "task", None), "app", None) is not self._app:
            return
        ids = _ax_ids(getattr(request, "request_dict", None))
        if ids is not None and _due_in_s(getattr(request, "eta", None)) > AHEAD_MIN_S:
            self.fence.prefence(*ids)

    def _on_failure(self, sender: Any = None, task_id: str | None = None,
                    exception: BaseException | None = None, **_: Any) -> None:
        """A run whose pool process died (or hit the hard time limit): "worker lost"."""
        if not self._ours(sender) or not _lost(exception):
            return
        ids = _ax_ids(getattr(sender, "request", None))
        why = _error(exception) if exception is not None else "the pool process died"
        fence = self.fence
        if ids is not None:
            ax_id, attempt = ids
            self.recorder.put(lambda: fence.lose(ax_id, attempt, why))
        elif task_id:  # a hard time limit: Celery pushes no request for its handlers
            self.recorder.put(lambda: self._lose_by_celery_id(task_id, why))

    def _lose_by_celery_id(self, celery_id: str, why: str) -> None:
        for ax_id, attempt in self._running_on_node():
            if celery_task_id(ax_id, attempt) == celery_id:
                self.fence.lose(ax_id, attempt, why)
                return

    def _running_on_node(self) -> list[tuple[int, int]]:
        from sqlalchemy import select

        from ax_kombu.store.schema import tasks

        with self.fence.store.engine.connect() as conn:
            return [(r.task_id, r.attempt) for r in conn.execute(
                select(tasks.c.task_id, tasks.c.attempt).where(
                    tasks.c.status == "RUNNING", tasks.c.owner_node == self.fence.node_id))]

    def _on_revoked(self, sender: Any = None, request: Any = None, terminated: bool = False,
                    signum: Any = None, expired: bool = False, **_: Any) -> None:
        """A revoked run (terminated, or never started): CANCELLED at its attempt."""
        ids = _ax_ids(request)
        if not self._ours(sender) or ids is None:
            return
        why = ("expired in Celery" if expired else
               f"revoked in Celery (terminated, signal {signum})" if terminated else
               "revoked in Celery")
        ax_id, attempt = ids
        fence = self.fence
        self.recorder.put(lambda: fence.cancel(ax_id, attempt, why))


def _forks(pool_cls: Any) -> bool:
    """Whether a worker's pool runs tasks in forked children (prefork)."""
    from celery.concurrency.prefork import TaskPool

    return isinstance(pool_cls, type) and issubclass(pool_cls, TaskPool)


def _due_in_s(eta: Any) -> float:
    """Seconds until a request's ``eta`` (a datetime, or ISO 8601 text); 0 without one."""
    if eta is None:
        return 0.0
    if isinstance(eta, str):
        try:
            eta = datetime.fromisoformat(eta)
        except ValueError:
            return 0.0
    if not isinstance(eta, datetime):
        return 0.0
    if eta.tzinfo is None:
        eta = eta.replace(tzinfo=UTC)
    return float((eta - datetime.now(UTC)).total_seconds())


def _lost(exception: BaseException | None) -> bool:
    """Whether a ``task_failure`` says the run's process died (not a failure the run
    recorded itself)."""
    from billiard.exceptions import WorkerLostError

    return isinstance(exception, (WorkerLostError, TimeLimitExceeded))
