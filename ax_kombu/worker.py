"""The ax-worker consumer: receive → RUNNING → ack → run → record.

One thread (the one calling :meth:`Worker.run`) owns the broker connection:
a Kombu consumer per queue (``high``, ``default``, ``slow``), each on its own
channel, each feeding its own bounded :class:`~ax_kombu.pools.Pool`.

Receipt, in batches. Messages that arrive within ``worker_batch_ms`` (or
until ``worker_batch_size``) are handled together:

1. each is planned into a free slot of its queue's pool; what cannot start
   waits in a small per-queue backlog (only with ``prefetch_multiplier`` >
   1, at most ``pool × (multiplier − 1)``), else is handed back;
2. ONE statement moves the startable ones DISPATCHING → RUNNING where the
   row's attempt equals the message's (the fencing token), setting
   ``started_at`` (database clock) and ``last_run_node`` = this worker; the
   handed-back ones go DISPATCHING → READY with ``last_run_node`` NULL;
3. only then are the messages acked; a message whose move failed (task
   cancelled, or a stale message from an earlier attempt) is logged with
   the reason, counted, acked and not run;
4. the started tasks are submitted to their pools. Their outcomes are
   written in batches by :class:`~ax_kombu.results.ResultWriter`.

Prefetch follows free capacity. The broker is never allowed more unacked
messages on a queue's channel than ``pool × multiplier − busy slots``: the
consumer's QoS is lowered *before* a batch is acked, raised as slots free
up, and the consumer is cancelled while the figure is 0 (a prefetch of 0
would mean "unlimited"). On RabbitMQ the QoS is per channel (``global``),
the only kind RabbitMQ changes on a live consumer. So a worker receives
only work it can start, and nothing waits in an unbounded queue. A slot
held by a timed-out thread counts as busy (see :mod:`ax_kombu.pools`), so
a hung task shrinks its queue's prefetch instead of letting work in that
cannot start. Kombu channels are not thread-safe: every ack, QoS change and
cancel happens on the consuming thread.

Guarantees:

* Execution is at-least-once. A task runs only after its RUNNING move
  committed, and only for the attempt in its message.
* ``kill -9``: started tasks stay RUNNING with this worker as
  ``last_run_node``; once its heartbeat stops, a scheduler recovers them
  (retry, or FAILED "worker lost"). Received but not yet started messages
  are still DISPATCHING: the broker redelivers them, or the scheduler's ack
  timeout dispatches them again.
* Warm shutdown (first SIGTERM/SIGINT, :meth:`Worker.request_stop`): stop
  consuming; hand received-but-unstarted work back to READY; let running
  tasks finish within ``worker_grace_s``; record the rest as abandoned (a
  failure that may retry); write every result; mark the heartbeat stopped;
  exit 0. Cold shutdown (a second signal, or SIGQUIT): the same without
  waiting for running tasks; exit 1.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from kombu import messaging
from kombu.entity import Queue
from kombu.exceptions import OperationalError
from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError

from . import states
from .broker import TaskMessage, connection, task_queues
from .config import PRIORITIES, Settings, redact_url
from .exceptions import ConfigurationError, StoreError
from .nodes import Heartbeat, default_node_id
from .pools import Outcome, Pool
from .processors import Context, Resolver, split_names
from .results import Counters, HeldConnection, ResultWriter
from .states import Status
from .store import Store
from .store.schema import tasks

log = logging.getLogger(__name__)

#: kombu is untyped: its consumer and connection are handled as Any
_Consumer: Any = messaging.Consumer

#: longest the consuming thread blocks on the broker before checking flags and credit
TICK_S = 0.01
#: while a queue is paused (its pool full), how long to wait for a slot before polling others
PAUSED_TICK_S = 0.002


class _BrokerLost(Exception):
    """The broker connection failed; the worker reconnects."""


@dataclass(eq=False)
class Delivery:
    """A received message, not yet acked."""

    lane: Lane
    task: TaskMessage
    message: Any
    shard: Mapping[str, Any] | None = None

    @property
    def pair(self) -> tuple[int, int]:
        return self.task.task_id, self.task.attempt

    @property
    def labels(self) -> dict[str, Any]:
        return {"task_id": self.task.task_id, "trace_id": self.task.trace_id,
                "attempt": self.task.attempt}


class Lane:
    """One queue: its pool, its consumer (own channel), its backlog and its credit."""

    def __init__(self, priority: str, queue: Queue, size: int, multiplier: int,
                 on_release: Callable[[], None]) -> None:
        self.priority = priority
        self.queue = queue
        self.pool = Pool(priority, size, on_release=on_release)
        self.window = size * multiplier
        self.backlog_max = size * (multiplier - 1)
        self.backlog: deque[Delivery] = deque()
        self.consumer: Any = None
        self.prefetch = 0
        self.consuming = False

    def credit(self, starting: int = 0) -> int:
        """Unacked messages the broker may hand this lane now."""
        return self.window - self.pool.busy - starting

    def apply_credit(self, credit: int, global_qos: bool) -> None:
        """Set the consumer's prefetch to ``credit``, cancelling it at 0."""
        consumer: Any = self.consumer
        if consumer is None:
            return
        if credit <= 0:
            if self.consuming:
                consumer.cancel()
                self.consuming = False
            return
        if credit != self.prefetch:
            consumer.qos(prefetch_count=credit, apply_global=global_qos)
            self.prefetch = credit
        if not self.consuming:
            consumer.consume()
            self.consuming = True

    def info(self) -> dict[str, int]:
        return {"size": self.pool.size, "free": self.pool.free, "stuck": self.pool.stuck,
                "backlog": len(self.backlog)}


def parse_queues(text: str | Iterable[str], settings: Settings) -> list[str]:
    """``"high,slow"`` (priorities or their queue names) as priorities, in order.

    Raises:
        ConfigurationError: an unknown queue, or none.
    """
    by_name = {settings.queue_for(p): p for p in PRIORITIES} | {p: p for p in PRIORITIES}
    chosen: list[str] = []
    for name in split_names(text):
        if name not in by_name:
            raise ConfigurationError(f"unknown queue {name!r}; use {', '.join(PRIORITIES)}")
        if by_name[name] not in chosen:
            chosen.append(by_name[name])
    if not chosen:
        raise ConfigurationError("no queue to consume (-Q high,default,slow)")
    return chosen


class Worker:
    """Consumes the given queues until stopped; see the module docstring.

    Args:
        settings: pool sizes, batching, backoff, store and broker.
        queues: the priorities to consume (default all three).
        node_id: this worker's node id (default ``worker@host.pid.xxxx``).
        resolver: how processor names resolve (default from the settings).
    """

    def __init__(self, settings: Settings, *, queues: Sequence[str] = PRIORITIES,
                 node_id: str | None = None, resolver: Resolver | None = None) -> None:
        self.settings = settings
        self.node_id = node_id or default_node_id("worker")
        self.store = Store(settings)
        self.resolver = resolver or Resolver(split_names(settings.processor_modules),
                                             split_names(settings.callback_allow_hosts))
        self.stats = Counters()
        self.results = ResultWriter(self.store, settings, self.stats)
        self.heartbeat = Heartbeat(self.store, self.node_id, "worker")
        self._slot_freed = threading.Event()
        broker_queues = task_queues(settings)
        self.lanes = [Lane(p, broker_queues[p], settings.pool_size(p),
                           settings.prefetch_multiplier, self._slot_freed.set)
                      for p in parse_queues(queues, settings)]
        self.ready = threading.Event()
        self.stopping = False
        self.cold = False
        self._pending: list[Delivery] = []
        self._global_qos = False
        self._heart_stop = threading.Event()
        self._db = HeldConnection(self.store.engine)

    # -- control (safe from signal handlers: they only set flags) ------------------------------

    def request_stop(self, cold: bool = False) -> None:
        """Warm stop; cold if ``cold`` or if a stop was already requested."""
        if cold or self.stopping:
            self.cold = True
        self.stopping = True

    def info(self) -> dict[str, Any]:
        """What the heartbeat publishes about this worker."""
        return {"queues": [lane.queue.name for lane in self.lanes],
                "pools": {lane.priority: lane.pool.size for lane in self.lanes},
                "free": {lane.priority: lane.pool.free for lane in self.lanes},
                "backlog": {lane.priority: len(lane.backlog) for lane in self.lanes},
                "stuck": {lane.priority: lane.pool.stuck for lane in self.lanes},
                "running": sum(lane.pool.active for lane in self.lanes),
                "counts": self.stats.snapshot()}

    # -- lifecycle -----------------------------------------------------------------------------

    def run(self) -> int:
        """Consume until stopped; returns the exit code (0 warm, 1 cold).

        Raises:
            StoreError: the store cannot be reached at start.
        """
        try:
            self.heartbeat.register(self.info())
        except SQLAlchemyError as exc:
            raise StoreError(f"cannot reach the store {redact_url(self.settings.database_url)}: "
                             f"{getattr(exc, 'orig', exc)}") from None
        self.results.start()
        beat = threading.Thread(target=self._beat, name="ax-heartbeat", daemon=True)
        beat.start()
        log.info("worker started", extra={"node": self.node_id,
                                          "broker": redact_url(self.settings.broker_url),
                                          "queues": [lane.queue.name for lane in self.lanes]})
        try:
            self._serve()
        finally:
            self._shutdown(beat)
        return 1 if self.cold else 0

    def _serve(self) -> None:
        pause = 0.5
        while not self.stopping:
            try:
                self._consume()
            except _BrokerLost as exc:
                self.ready.clear()
                self._pending.clear()
                for lane in self.lanes:
                    lane.backlog.clear()  # unacked: the broker or the ack timeout returns them
                log.warning("broker connection lost; reconnecting", extra={
                    "error": repr(exc.__cause__), "retry_in_s": pause})
                self._sleep(pause)
                pause = min(pause * 2, 10.0)

    def _consume(self) -> None:
        conn: Any = connection(self.settings)
        if conn.transport.driver_type == "redis":
            # acked within ms of receipt; a message lost in between is still DISPATCHING
            # in the store and dispatched again after the ack timeout.
            conn.transport_options["ack_emulation"] = False
        errors = (OSError, OperationalError, *conn.connection_errors, *conn.channel_errors)
        try:
            conn.ensure_connection(max_retries=1)
            self._global_qos = conn.transport.driver_type == "amqp"
            self._open(conn)
            self.ready.set()
            while not self.stopping:
                self._receive(conn)
                self._handle()
                for lane in self.lanes:
                    lane.apply_credit(lane.credit(), self._global_qos)
            self._stop_consuming()
        except errors as exc:
            raise _BrokerLost() from exc
        finally:
            for lane in self.lanes:
                lane.consumer = None
            try:
                conn.release()
            except Exception:  # noqa: BLE001 - closing a broken connection
                log.debug("error closing the broker connection", exc_info=True)

    def _open(self, conn: Any) -> None:
        for lane in self.lanes:
            lane.consumer = _Consumer(conn.channel(), queues=[lane.queue], accept=["json"],
                                     callbacks=[partial(self._on_message, lane)],
                                     on_decode_error=self._on_decode_error)
            lane.consuming = False
            lane.prefetch = 0
            lane.apply_credit(lane.credit(), self._global_qos)

    def _beat(self) -> None:
        while not self._heart_stop.wait(self.settings.heartbeat_interval_s):
            try:
                self.heartbeat.beat(self.info())
            except Exception:  # noqa: BLE001 - a missed beat is retried next interval
                log.warning("heartbeat failed", exc_info=True, extra={"node": self.node_id})

    def _sleep(self, seconds: float) -> None:
        stop = time.monotonic() + seconds
        while not self.stopping and time.monotonic() < stop:
            time.sleep(TICK_S)

    # -- receiving -----------------------------------------------------------------------------

    def _on_message(self, lane: Lane, body: Any, message: Any) -> None:
        try:
            task = TaskMessage.from_body(body)
        except ValueError as exc:
            self.stats.add("malformed")
            log.warning("malformed message dropped", extra={"queue": lane.queue.name,
                                                            "error": str(exc)})
            message.ack()
            return
        shard = body.get("shard")
        self._pending.append(Delivery(lane, task, message,
                                      shard if isinstance(shard, Mapping) else None))

    def _on_decode_error(self, message: Any, exc: Exception) -> None:
        self.stats.add("malformed")
        log.warning("undecodable message dropped (JSON only)", extra={
            "content_type": getattr(message, "content_type", None), "error": str(exc)})
        message.reject()

    def _receive(self, conn: Any) -> None:
        """Drain what arrives within one batch window, starting from a short wait.

        While some queue is paused (its pool full) the wait is for a slot to free
        up, so that queue resumes at once; the other queues are polled between.
        """
        paused = any(not lane.consuming for lane in self.lanes)
        if paused:
            woke = self._slot_freed.wait(TICK_S if self._all_paused() else PAUSED_TICK_S)
            self._slot_freed.clear()
            if woke or self._all_paused():
                return
        room = sum(max(0, lane.prefetch - len(lane.backlog))
                   for lane in self.lanes if lane.consuming)
        limit = min(self.settings.worker_batch_size, room)
        try:
            conn.drain_events(timeout=TICK_S / 100 if paused else TICK_S)
        except socket.timeout:
            return
        deadline = time.monotonic() + self.settings.worker_batch_ms / 1000.0
        while len(self._pending) < limit:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                conn.drain_events(timeout=left)
            except socket.timeout:
                break

    def _all_paused(self) -> bool:
        return not any(lane.consuming for lane in self.lanes)

    # -- handling a batch ----------------------------------------------------------------------

    def _handle(self) -> None:
        fresh, self._pending = self._pending, []
        if not fresh and not any(lane.backlog and lane.pool.free for lane in self.lanes):
            return
        start, release, dupes = self._plan(fresh)
        started = self._record_receipt(start, release)
        if started is None:
            return
        for lane in self.lanes:  # lower the prefetch before the acks open the window
            n = sum(1 for d in start if d.lane is lane and d.task.task_id in started)
            lane.apply_credit(lane.credit(n), self._global_qos)
        try:
            self._ack(start, release, dupes, started)
        finally:
            for delivery in start:
                if delivery.task.task_id in started:
                    self._submit(delivery)

    def _plan(self, fresh: list[Delivery]) -> tuple[list[Delivery], list[Delivery],
                                                    list[Delivery]]:
        """Split into (start now, hand back to READY, duplicates to drop)."""
        newest: dict[int, Delivery] = {}
        dupes: list[Delivery] = []
        for d in [d for lane in self.lanes for d in lane.backlog] + fresh:
            kept = newest.get(d.task.task_id)
            if kept is None:
                newest[d.task.task_id] = d
            elif d.task.attempt > kept.task.attempt:  # only the newest attempt can be live
                dupes.append(kept)
                newest[d.task.task_id] = d
            else:
                dupes.append(d)
        start: list[Delivery] = []
        release: list[Delivery] = []
        for lane in self.lanes:
            queued = [d for d in newest.values() if d.lane is lane]
            lane.backlog.clear()
            free = lane.pool.free
            start.extend(queued[:free])
            for d in queued[free:]:
                (lane.backlog if len(lane.backlog) < lane.backlog_max else release).append(d)
        return start, release, dupes

    def _record_receipt(self, start: list[Delivery],
                        release: list[Delivery]) -> set[int] | None:
        """The RUNNING move (and the hand-back), retried through a database outage.

        Returns the ids now RUNNING, or None if stopping while the database is down
        (the messages stay unacked; the broker gets them back when we disconnect).
        """
        pause = 0.05
        while True:
            try:
                with self._db.begin() as conn:
                    started = states.start_many(conn, [d.pair for d in start], self.node_id,
                                                self.store.now_ms())
                    states.release_many(conn, [d.pair for d in release])
                return set(started)
            except SQLAlchemyError:
                log.warning("could not record received tasks; retrying", exc_info=True,
                            extra={"count": len(start) + len(release)})
                if self.stopping:
                    return None
                self._sleep(pause)
                pause = min(pause * 2, 2.0)

    def _ack(self, start: list[Delivery], release: list[Delivery], dupes: list[Delivery],
             started: set[int]) -> None:
        refused = [d for d in start if d.task.task_id not in started]
        self.stats.add("received", len(start) + len(release) + len(dupes))
        self.stats.add("started", len(start) - len(refused))
        for delivery in start + release + dupes:
            delivery.message.ack()
        for delivery in release:
            self.stats.add("handed_back")
            log.info("pool full: task handed back to the scheduler as READY",
                     extra={**delivery.labels, "queue": delivery.lane.queue.name})
        for delivery in dupes:
            self.stats.add("refused_duplicate")
            log.info("duplicate delivery dropped", extra=delivery.labels)
        if refused:
            self._explain(refused)

    def _explain(self, refused: list[Delivery]) -> None:
        """Log and count why each RUNNING move failed (one read for the batch)."""
        ids = [d.task.task_id for d in refused]
        try:
            with self.store.engine.connect() as conn:
                rows = {r.task_id: r for r in conn.execute(
                    select(tasks.c.task_id, tasks.c.status, tasks.c.attempt)
                    .where(tasks.c.task_id.in_(ids)))}
        except SQLAlchemyError:
            rows = {}
        for delivery in refused:
            reason, why = _refusal(delivery.task, rows.get(delivery.task.task_id))
            self.stats.add(f"refused_{reason}")
            log.info("message refused, not run", extra={**delivery.labels, "reason": why})

    def _submit(self, delivery: Delivery) -> None:
        task = delivery.task
        ctx = Context(task.task_id, task.attempt, task.trace_id, task.trigger_time,
                      task.task_type, task.retry_count, task.max_retry, task.timeout_ms,
                      delivery.shard)
        done = partial(self.results.put, task)
        if not delivery.lane.pool.try_submit(partial(self._execute, task, ctx), done,
                                             timeout_s=task.timeout_ms / 1000.0,
                                             labels=delivery.labels):
            done(Outcome(False, abandoned="no free slot in the pool"))  # planned: cannot happen

    def _execute(self, task: TaskMessage, ctx: Context) -> Any:
        func = self.resolver.resolve(task.processor, task.callback_url)
        return func(task.payload, ctx)

    # -- stopping ------------------------------------------------------------------------------

    def _stop_consuming(self) -> None:
        """Cancel the consumers and hand received-but-unstarted work back to READY."""
        for lane in self.lanes:
            if lane.consumer is not None and lane.consuming:
                lane.consumer.cancel()
                lane.consuming = False
        unstarted = self._pending + [d for lane in self.lanes for d in lane.backlog]
        self._pending = []
        for lane in self.lanes:
            lane.backlog.clear()
        if not unstarted:
            return
        try:
            with self._db.begin() as conn:
                states.release_many(conn, [d.pair for d in unstarted])
        except SQLAlchemyError:
            log.warning("could not hand work back to READY; returning it to the broker",
                        exc_info=True, extra={"count": len(unstarted)})
            for delivery in unstarted:
                delivery.message.reject(requeue=True)
            return
        for delivery in unstarted:
            delivery.message.ack()
        self.stats.add("handed_back", len(unstarted))
        log.info("unstarted work handed back to READY", extra={"count": len(unstarted)})

    def _shutdown(self, beat: threading.Thread) -> None:
        self.ready.clear()
        self._wait_for_running()
        for lane in self.lanes:
            lane.pool.abandon("worker shut down before the task finished")
        if not self.results.stop(self.settings.worker_grace_s + 5.0):
            log.error("not every result could be written before exit")
        self._heart_stop.set()
        beat.join(5.0)
        try:
            self.heartbeat.stop()
        except SQLAlchemyError:
            log.warning("could not mark the heartbeat stopped", exc_info=True)
        for lane in self.lanes:
            lane.pool.close()
        self._db.close()
        self.store.close()
        log.info("worker stopped", extra={"node": self.node_id, "cold": self.cold,
                                          "counts": self.stats.snapshot()})

    def _wait_for_running(self) -> None:
        stop = time.monotonic() + self.settings.worker_grace_s
        while not self.cold and time.monotonic() < stop:
            if all(lane.pool.join(TICK_S * 5) for lane in self.lanes):
                return


def _refusal(task: TaskMessage, row: Any) -> tuple[str, str]:
    """(counter suffix, log text) for a message whose RUNNING move failed."""
    if row is None:
        return "missing", "no such task"
    if row.attempt != task.attempt:
        return "stale", f"stale message: attempt {task.attempt}, the task is at {row.attempt}"
    if row.status == Status.CANCELLED:
        return "cancelled", "the task was cancelled"
    return "state", f"the task is {row.status}, not DISPATCHING"
