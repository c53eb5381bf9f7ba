"""The optional worker extension: :class:`AxBootstep` fences and records Celery runs in ax.

Enabled with one line where the Celery app is made::

    app.steps["worker"].add(ax_kombu.celery.AxBootstep)

With it, a Celery worker takes part in ax as an ax-worker does, for the Celery-bound
tasks it receives (those carrying the ``ax_task_id`` and ``ax_attempt`` headers):

* **Fenced start**: before the task body runs, the row moves DISPATCHING → RUNNING by
  compare-and-set on ``(task_id, attempt)``, with ``last_run_node`` = this worker's ax
  node. A message whose attempt is not the row's (stale, duplicated, cancelled meanwhile)
  is refused: Celery's ``Ignore`` — acked, the body never runs.
* **Recorded end**: SUCCESS after the body returns; after an exception, FAILED when no
  ax retries remain, else DELAYED with ax's backoff (ax dispatches a new attempt, under a
  new Celery id). A Celery retry (``self.retry()``, ``autoretry_for``) is Celery's own:
  the ax attempt ends SUCCESS as handed to Celery (``result.celery_retry``), and the
  retried message (``retries`` > 0) runs unfenced.
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

Caveat: the ack timeout (``AX_ACK_TIMEOUT_MS``, doubling per re-dispatch) now also covers
the time a message waits in a backlogged Celery queue or a worker's prefetch before it
starts; set it above that wait, or ax re-dispatches (the old message is refused when its
turn comes) and, after ``AX_MAX_DISPATCHES``, fails the task.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from celery import bootsteps
from celery.app.trace import task_has_custom
from celery.exceptions import Ignore, Retry

from ax_kombu.broker.celery_wire import celery_task_id
from ax_kombu.config import Settings, from_env
from ax_kombu.core.backoff import backoff_ms, default_rng
from ax_kombu.core.states import Status
from ax_kombu.store import Store
from ax_kombu.store import gates as gate_store
from ax_kombu.store.nodes import Heartbeat
from ax_kombu.store.tasks import wake_schedulers
from ax_kombu.store.transitions import Attempt, Finish, Started, finish_many, record_attempts
from ax_kombu.store.transitions import start_many as start_rows

log = logging.getLogger(__name__)
_MARK = "__ax_fenced__"


class Fence:
    """The ax side of one Celery worker: its node, and the start and end of each run.

    Safe in every pool: each process (prefork children included) opens its own store
    on first use.
    """

    def __init__(self, settings: Settings, node_id: str) -> None:
        self.settings = settings
        self.node_id = node_id
        self._store: Store | None = None
        self._pid = 0
        self._lock = threading.Lock()
        self.heartbeat: Heartbeat | None = None
        self._stop = threading.Event()

    @property
    def store(self) -> Store:
        with self._lock:
            if self._store is None or self._pid != os.getpid():
                self._store, self._pid = Store(self.settings), os.getpid()
            return self._store

    # -- the node -------------------------------------------------------------------------

    def register(self, queues: list[str]) -> None:
        """Become an ax node and heartbeat (on a daemon thread) until the process exits."""
        info = {"celery": True, "celery_queues": queues}
        self.heartbeat = Heartbeat(self.store, self.node_id, "worker",
                                   silence_ms=self.settings.silence_ms)
        self.heartbeat.register(info)
        threading.Thread(target=self._beat, args=(info,), name="ax-celery-heartbeat",
                         daemon=True).start()
        atexit.register(self.unregister)

    def _beat(self, info: dict[str, Any]) -> None:
        heartbeat = self.heartbeat
        assert heartbeat is not None
        while not self._stop.wait(self.settings.heartbeat_interval_s):
            try:
                if not heartbeat.beat(info):
                    log.warning("this Celery worker was declared dead by ax; registering anew",
                                extra={"node": self.node_id})
                    heartbeat.register(info)
            except Exception:  # a database outage: try again at the next beat
                log.warning("ax heartbeat failed", exc_info=True, extra={"node": self.node_id})

    def unregister(self) -> None:
        """Stop beating and mark the node stopped (a clean exit: nothing runs any more)."""
        self._stop.set()
        heartbeat, self.heartbeat = self.heartbeat, None  # once
        if heartbeat is not None and self._pid == os.getpid():
            try:
                heartbeat.stop()
            except Exception:  # the process is exiting; the silence window covers it
                log.warning("could not mark the ax node stopped", exc_info=True)

    # -- the runs -------------------------------------------------------------------------

    def start(self, task_id: int, attempt: int) -> Started | None:
        """DISPATCHING → RUNNING for this attempt; None if the row is not at it (refuse)."""
        store = self.store
        with store.engine.begin() as conn:
            rows = start_rows(conn, [(task_id, attempt)], self.node_id, store.now_ms())
        return rows[0] if rows else None

    def finish(self, task: Started, attempt: int, error: str | None,
               result: str | None = None) -> bool:
        """Record the end of a run started by :meth:`start`; returns whether it moved."""
        store = self.store
        now = store.now_ms()
        if error is None:
            end = Finish(task.task_id, attempt, Status.SUCCESS, now, result=result)
        elif task.retry_count >= task.max_retry:
            end = Finish(task.task_id, attempt, Status.FAILED, now, error)
        else:
            delay = backoff_ms(task.retry_count, self.settings.retry_backoff_base_ms,
                               self.settings.retry_backoff_max_ms, default_rng(),
                               self.settings.retry_backoff_jitter)
            end = Finish(task.task_id, attempt, Status.DELAYED, now + delay, error)
        with store.engine.begin() as conn:
            moved = bool(finish_many(conn, [end]))
            if end.status is Status.DELAYED and moved:
                record_attempts(conn, [Attempt(task.task_id, attempt, task.task_type,
                                               self.node_id, task.trigger_time, None,
                                               task.started_at, now, "RETRY", error)])
                wake_schedulers(conn, end.at_ms)
            if task.gated:
                gate_store.wake_next(conn, [(task.task_type, task.order_key)])
        return moved


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

        fence = fence_of()
        ax_id, attempt = request.get("ax_task_id"), request.get("ax_attempt")
        if fence is None or ax_id is None or attempt is None or request.retries:
            return body()
        started = fence.start(int(ax_id), int(attempt))
        if started is None:
            log.info("stale or duplicate ax message refused",
                     extra={"task_id": ax_id, "attempt": attempt, "celery_id": request.id})
            raise Ignore()
        try:
            value = body()
        except Retry:
            fence.finish(started, int(attempt), None, json.dumps(
                {"celery_task_id": celery_task_id(int(ax_id), int(attempt)),
                 "celery_retry": True}))
            raise
        except Exception as exc:
            fence.finish(started, int(attempt), f"{type(exc).__name__}: {exc}"[:2000])
            raise
        fence.finish(started, int(attempt), None, _json_or_none(value))
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


class AxBootstep(bootsteps.StartStopStep):  # type: ignore[misc]  # Celery is untyped
    """A Celery worker step: fence and record ax's Celery-bound runs (module docstring)."""

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        self.fence = Fence(from_env(), f"celery@{worker.hostname}")
        fence_tasks(worker.app, lambda: self.fence)

    def start(self, worker: Any) -> None:
        queues = sorted(q.name for q in worker.app.amqp.queues.consume_from.values())
        self.fence.register(queues)
        log.info("ax fencing Celery runs", extra={"node": self.fence.node_id})
