"""The ax-worker consumer: receive → RUNNING → run → record → ack.

One thread (the one calling :meth:`Worker.run`) owns the broker connection:
a Kombu consumer per queue (``high``, ``default``, ``slow``), each on its own
channel and feeding its own bounded pool — a :class:`~ax_kombu.worker.lanes.Lane`.
Only this thread touches Kombu's channels (they are not thread-safe). On
Redis ≥ 6.2 (unless ``redis_pull`` is off) a puller thread
(:mod:`ax_kombu.broker.redis_pull`) receives instead, many messages per round trip and
never more than each lane's room; it only uses the channel's connection pool.

Receipt, in batches. The consuming thread drains the broker and plans what
arrived:

1. each message is planned into a free slot of its lane's pool; what cannot
   start waits in the lane's backlog (only with ``prefetch_multiplier`` > 1,
   at most ``pool × (multiplier − 1)``), else is handed back;
2. the receipt stage (:mod:`ax_kombu.worker.receipts`, its own thread) moves the
   startable tasks DISPATCHING → RUNNING in ONE statement, only where the
   row's attempt equals the message's (the fencing token), setting
   ``started_at`` (database clock) and ``last_run_node`` = this worker; the
   handed-back ones go DISPATCHING → READY with ``last_run_node`` NULL.
   Meanwhile the consuming thread keeps draining, so the next batch is what
   arrived during this one's round trip (at most ``worker_batch_size``);
3. a message whose move failed (task cancelled, or a stale message from an
   earlier attempt) is logged with the reason, counted, acked, not run;
4. the started tasks go to their pools; each outcome is written in a batch
   by :class:`~ax_kombu.worker.results.ResultWriter`, and its message is acked.

A message is acked only after its RUNNING move committed, and normally
stays unacked while its task runs: the broker's prefetch (``pool ×
multiplier``) then bounds exactly what a lane holds, so a worker is only
handed work it can start and nothing waits in an unbounded queue. See
:mod:`ax_kombu.worker.lanes` for the runs that hold a slot without a message
(timed-out threads, tasks allowed over ten minutes) and how the prefetch
shrinks for them.

Guarantees:

* Execution is at-least-once. A task runs only after its RUNNING move
  committed, and only for the attempt in its message.
* ``kill -9``: started tasks stay RUNNING with this worker as
  ``last_run_node``; once its heartbeat stops, a scheduler recovers them
  (retry, or FAILED "worker lost"); RabbitMQ hands their unacked messages
  to another worker, which refuses them (the task is not DISPATCHING).
  Received but unstarted tasks are still DISPATCHING: RabbitMQ redelivers
  them, or the scheduler's ack timeout dispatches them again. That is why
  Redis's ack emulation is turned off here: the database covers its window.
* Warm shutdown (first SIGTERM/SIGINT, :meth:`Worker.request_stop`): stop
  consuming; hand received-but-unstarted work back to READY; let running
  tasks finish within ``worker_grace_s``; record the rest as abandoned (a
  failure that may retry); write every result; mark the heartbeat stopped;
  exit 0. Cold shutdown (a second signal, or SIGQUIT): the same without
  waiting for running tasks; exit 1.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

from kombu import messaging
from kombu.exceptions import OperationalError
from kombu.serialization import prepare_accept_content
from sqlalchemy.exc import SQLAlchemyError

from ax_kombu.broker import redis_pull as intake
from ax_kombu.broker.connection import connection, task_queues
from ax_kombu.broker.messages import TaskMessage
from ax_kombu.config import PRIORITIES, Settings, redact_url
from ax_kombu.exceptions import StoreError
from ax_kombu.store import Store, transitions
from ax_kombu.store.nodes import Heartbeat, default_node_id
from ax_kombu.worker.lanes import ACK_AT_START_MS, Delivery, Lane, parse_queues, plan
from ax_kombu.worker.pools import Outcome
from ax_kombu.worker.processors import Context, Resolver, split_names
from ax_kombu.worker.receipts import Batch, ReceiptWriter, account
from ax_kombu.worker.results import Counters, HeldConnection, ResultWriter

log = logging.getLogger(__name__)

#: kombu is untyped: its consumer and connection are handled as Any
_Consumer: Any = messaging.Consumer

#: longest the consuming thread blocks on the broker before checking flags
TICK_S = 0.01
#: while a lane is saturated, how long to wait for a run to end before polling the others
SATURATED_TICK_S = 0.002
#: how long a poll waits for one more message before the batch is cut
POLL_S = 0.0005


class _BrokerLost(Exception):
    """The broker connection failed; the worker reconnects."""


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
        self._wakeup = threading.Event()
        broker_queues = task_queues(settings)
        self.lanes = [Lane(p, broker_queues[p], settings.pool_size(p),
                           settings.prefetch_multiplier, self._poke)
                      for p in parse_queues(queues, settings)]
        #: set while consuming (tests wait for it)
        self.ready = threading.Event()
        self.stopping = False
        self.cold = False
        self._pending: list[Delivery] = []
        self._running: set[Delivery] = set()
        self._completed: queue.SimpleQueue[Delivery] = queue.SimpleQueue()
        self._generation = 0
        self._global_qos = False
        self._puller: intake.Puller | None = None
        #: acks per lane not yet reported to the puller
        self._released = [0] * len(self.lanes)
        self._heart_stop = threading.Event()
        self._db = HeldConnection(self.store.engine)
        self.receipts = ReceiptWriter(self.store, self.node_id, self._poke,
                                      lambda: self.stopping, settings.worker_receipt_writers)

    # -- control (safe from signal handlers: they only set flags) ------------------------------

    def request_stop(self, cold: bool = False) -> None:
        """Warm stop; cold if ``cold`` or if a stop was already requested."""
        if cold or self.stopping:
            self.cold = True
        self.stopping = True

    def info(self) -> dict[str, Any]:
        """What the heartbeat publishes about this worker."""
        lanes = {lane.priority: lane.info() for lane in self.lanes}
        return {"queues": [lane.queue.name for lane in self.lanes],
                "pools": {p: i["size"] for p, i in lanes.items()},
                "free": {p: i["free"] for p, i in lanes.items()},
                "backlog": {p: i["backlog"] for p, i in lanes.items()},
                "stuck": {p: i["stuck"] for p, i in lanes.items()},
                "running": sum(i["running"] for i in lanes.values()),
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
                self._orphan()
                log.warning("broker connection lost; reconnecting", extra={
                    "error": repr(exc.__cause__), "retry_in_s": pause})
                self._sleep(pause)
                pause = min(pause * 2, 10.0)

    def _consume(self) -> None:
        conn: Any = connection(self.settings)
        if conn.transport.driver_type == "redis":
            conn.transport_options["ack_emulation"] = False  # see the module docstring
        errors = (OSError, OperationalError, *conn.connection_errors, *conn.channel_errors)
        try:
            conn.ensure_connection(max_retries=1)
            self._attach(conn)
            self.ready.set()
            while not self.stopping:
                self._wakeup.clear()
                self._settle()
                self._give_room()
                self._receive(conn)
                self._dispatch()
            self._stop_consuming()
            self._finish_running(connected=True)
        except errors as exc:
            raise _BrokerLost() from exc
        finally:
            self.ready.clear()
            if self._puller is not None:
                self._puller.stop()
                self._puller = None
            for lane in self.lanes:
                lane.consumer, lane.pulled = None, None
            try:
                conn.release()
            except Exception:  # closing a broken connection
                log.debug("error closing the broker connection", exc_info=True)

    def _attach(self, conn: Any) -> None:
        self._generation += 1
        self._global_qos = conn.transport.driver_type == "amqp"
        if self.settings.redis_pull and intake.supported(conn):  # batches (ax_kombu.broker.redis_pull)
            self._released = [0] * len(self.lanes)
            self._puller = intake.Puller(conn.channel(), [lane.queue.name for lane in self.lanes],
                                         prepare_accept_content(["json"]), self._poke)
            for index, lane in enumerate(self.lanes):
                lane.attach(None, self._global_qos, partial(self._puller.set_limit, index))
            self._puller.start()
            return
        for lane in self.lanes:
            consumer = _Consumer(conn.channel(), queues=[lane.queue], accept=["json"],
                                 callbacks=[partial(self._on_message, lane, self._generation)],
                                 on_decode_error=self._on_decode_error)
            lane.attach(consumer, self._global_qos)

    def _orphan(self) -> None:
        """After a lost connection: unacked messages are the broker's again."""
        self._generation += 1  # acks for the lost connection's messages are void from now on
        while self.receipts.in_flight:
            batch = self.receipts.take(timeout_s=60.0)
            if batch is None:
                break
            self._receipted(batch)
        self._pending.clear()
        for lane in self.lanes:
            lane.backlog.clear()
        for delivery in self._running:
            if not delivery.acked:
                delivery.acked = True  # its run goes on, holding a slot without a message
                delivery.lane.acked_running += 1

    def _beat(self) -> None:
        while not self._heart_stop.wait(self.settings.heartbeat_interval_s):
            try:
                self.heartbeat.beat(self.info())
            except Exception:  # a missed beat is retried next interval
                log.warning("heartbeat failed", exc_info=True, extra={"node": self.node_id})

    def _sleep(self, seconds: float) -> None:
        stop = time.monotonic() + seconds
        while not self.stopping and time.monotonic() < stop:
            time.sleep(TICK_S)

    # -- receiving -----------------------------------------------------------------------------

    def _on_message(self, lane: Lane, generation: int, body: Any, message: Any) -> None:
        lane.held += 1
        try:
            task = TaskMessage.from_body(body)
        except ValueError as exc:
            self.stats.add("malformed")
            log.warning("malformed message dropped", extra={"queue": lane.queue.name,
                                                            "error": str(exc)})
            message.ack()
            lane.held -= 1
            return
        shard = body.get("shard")
        self._pending.append(Delivery(lane, task, message, generation,
                                      shard if isinstance(shard, Mapping) else None))

    def _on_decode_error(self, message: Any, exc: Exception) -> None:
        self.stats.add("malformed")
        log.warning("undecodable message dropped (JSON only)", extra={
            "content_type": getattr(message, "content_type", None), "error": str(exc)})
        message.reject()  # never delivered to _on_message, so never counted as held

    def _receive(self, conn: Any) -> None:
        """Drain the broker until nothing more is ready, a batch is full, or we are needed.

        On Redis a puller thread receives instead (:meth:`_take_pulled`).

        Idle, it blocks up to TICK_S for a first message. While a receipt is in
        flight or a lane is saturated it only polls, and returns as soon as there
        is something to settle (a written batch, an ended run whose ack frees room).
        """
        if self._puller is not None:
            self._take_pulled(self._puller)
            return
        saturated = any(lane.saturated() for lane in self.lanes)
        if all(lane.saturated() for lane in self.lanes):
            self._wakeup.wait(TICK_S)
            return
        if saturated and not self.receipts.in_flight and self._wakeup.wait(SATURATED_TICK_S):
            return
        urgent = saturated or self.receipts.in_flight > 0
        limit = min(self.settings.worker_batch_size, sum(lane.room() for lane in self.lanes))
        timeout = POLL_S if urgent else TICK_S
        while len(self._pending) < limit and not (urgent and self._wakeup.is_set()):
            try:
                conn.drain_events(timeout=timeout)
            except TimeoutError:
                return
            timeout = POLL_S

    def _take_pulled(self, puller: intake.Puller) -> None:
        """Take what the puller popped (see :mod:`ax_kombu.broker.redis_pull`); wait if nothing."""
        if puller.error is not None:
            raise puller.error
        if not puller.inbox:
            self._wakeup.wait(POLL_S if self.receipts.in_flight else TICK_S)
        self._drain_pulled(puller)

    def _drain_pulled(self, puller: intake.Puller) -> None:
        while puller.inbox:
            pulled = puller.inbox.popleft()
            lane, message = self.lanes[pulled.lane], pulled.message
            if message is None:
                puller.release(pulled.lane)
                self.stats.add("malformed")
                log.warning("malformed message dropped (not a Kombu message)",
                            extra={"queue": lane.queue.name, "error": str(pulled.error)})
                continue
            if pulled.error is not None:
                puller.release(pulled.lane)
                self._on_decode_error(message, pulled.error)
                continue
            self._on_message(lane, self._generation, pulled.body, message)

    # -- handing batches to the receipt stage --------------------------------------------------

    def _dispatch(self) -> None:
        """Plan what arrived and send it to the receipt stage, if that is free."""
        if self.receipts.full:
            return
        fresh, self._pending = self._pending, []
        if not fresh and not any(lane.backlog and lane.free() for lane in self.lanes):
            return
        start, release, dupes = plan(self.lanes, fresh)
        if start or release or dupes:
            self.receipts.send(Batch(start, release, dupes))

    def _receipted(self, batch: Batch) -> None:
        """A batch's RUNNING move committed: ack what will not run, start the rest."""
        for delivery in batch.start:
            delivery.lane.reserved -= 1
        if batch.started is None:
            return  # given up while stopping: unacked, the broker gets them back
        started = batch.started
        refused = [d for d in batch.start if d.task.task_id not in started]
        for delivery in batch.release + batch.dupes + refused:
            self._ack(delivery)
        account(batch, refused, self.stats)
        running = [d for d in batch.start if d.task.task_id in started]
        self._ack_long(running)
        for delivery in running:
            self._submit(delivery)

    # -- running and settling ------------------------------------------------------------------

    def _ack_long(self, running: list[Delivery]) -> None:
        """Ack at start the messages of tasks allowed over ACK_AT_START_MS (lanes.py)."""
        long_runs = [d for d in running if d.task.timeout_ms > ACK_AT_START_MS]
        for delivery in long_runs:
            delivery.lane.acked_running += 1
        for lane in {d.lane for d in long_runs}:
            lane.apply(self._global_qos)  # the prefetch shrinks before the acks land
        for delivery in long_runs:
            self._ack(delivery)

    def _submit(self, delivery: Delivery) -> None:
        task = delivery.task
        ctx = Context(task.task_id, task.attempt, task.trace_id, task.trigger_time,
                      task.task_type, task.retry_count, task.max_retry, task.timeout_ms,
                      delivery.shard)
        done = partial(self._done, delivery)
        self._running.add(delivery)
        if not delivery.lane.pool.try_submit(partial(self._execute, task, ctx), done,
                                             timeout_s=task.timeout_ms / 1000.0,
                                             labels=delivery.labels):
            done(Outcome(False, abandoned="no free slot in the pool"))  # planned: cannot happen

    def _execute(self, task: TaskMessage, ctx: Context) -> Any:
        func = self.resolver.resolve(task.processor, task.callback_url)
        return func(task.payload, ctx)

    def _done(self, delivery: Delivery, outcome: Outcome) -> None:
        """A run's outcome (pool thread): to the result writer, and back to us for the ack."""
        self.results.put(delivery.task, outcome)
        self._completed.put(delivery)
        self._poke()

    def _poke(self) -> None:
        """Wake the consuming thread (from any thread).

        Setting an Event takes its lock and notifies; when it is already set the
        consuming thread has not cleared it yet and will look at everything put
        before this call, so the set is skipped (it was most of a pool thread's
        work per task).
        """
        if not self._wakeup.is_set():
            self._wakeup.set()

    def _settle(self) -> None:
        """Start a written batch; ack ended runs; bring every lane's prefetch up to date."""
        while (batch := self.receipts.take()) is not None:
            self._receipted(batch)
        ended: list[Delivery] = []
        while True:
            try:
                ended.append(self._completed.get_nowait())
            except queue.Empty:
                break
        for delivery in ended:
            self._running.discard(delivery)
            if delivery.acked:
                delivery.lane.acked_running -= 1
        if not self.stopping:
            for lane in self.lanes:  # before the acks: a stuck slot lowers the prefetch
                lane.apply(self._global_qos)
        for delivery in ended:
            self._ack(delivery)

    def _ack(self, delivery: Delivery) -> None:
        if delivery.acked or delivery.generation != self._generation:
            return
        delivery.acked = True
        delivery.lane.held -= 1
        delivery.message.ack()
        if self._puller is not None:
            self._released[self.lanes.index(delivery.lane)] += 1

    def _give_room(self) -> None:
        """Tell the puller, once per loop, how much room the acks since the last call freed."""
        if self._puller is not None:
            for index, n in enumerate(self._released):
                if n:
                    self._puller.release(index, n)
        self._released = [0] * len(self.lanes)

    # -- stopping ------------------------------------------------------------------------------

    def _stop_consuming(self) -> None:
        """Cancel the consumers and hand received-but-unstarted work back to READY."""
        for lane in self.lanes:
            if lane.consumer is not None and lane.consuming:
                lane.consumer.cancel()
            lane.consuming = False
        if self._puller is not None:
            self._puller.stop()
            self._drain_pulled(self._puller)
        while self.receipts.in_flight:  # batches in flight start (or are given up) first
            batch = self.receipts.take(timeout_s=TICK_S)
            if batch is not None:
                self._receipted(batch)
        unstarted = self._pending + [d for lane in self.lanes for d in lane.backlog]
        self._pending = []
        for lane in self.lanes:
            lane.backlog.clear()
        if not unstarted:
            return
        try:
            with self._db.begin() as conn:
                transitions.release_many(conn, [d.pair for d in unstarted])
        except SQLAlchemyError:
            log.warning("could not hand work back to READY; returning it to the broker",
                        exc_info=True, extra={"count": len(unstarted)})
            for delivery in unstarted:
                delivery.message.reject(requeue=True)
            return
        for delivery in unstarted:
            self._ack(delivery)
        self.stats.add("handed_back", len(unstarted))
        log.info("unstarted work handed back to READY", extra={"count": len(unstarted)})

    def _finish_running(self, connected: bool) -> None:
        """Let running tasks end within the grace period (not if cold); abandon the rest."""
        stop = time.monotonic() + self.settings.worker_grace_s
        while (not self.cold and time.monotonic() < stop
               and any(lane.pool.active for lane in self.lanes)):
            self._wakeup.clear()
            if connected:
                self._settle()
            self._wakeup.wait(TICK_S * 5)
        abandoned = sum(lane.pool.abandon("worker shut down before the task finished")
                        for lane in self.lanes)
        if abandoned:
            log.warning("running tasks abandoned at shutdown", extra={"count": abandoned})
        if connected:
            self._settle()

    def _shutdown(self, beat: threading.Thread) -> None:
        self._finish_running(connected=False)
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
        self.receipts.close()
        self._db.close()
        self.store.close()
        log.info("worker stopped", extra={"node": self.node_id, "cold": self.cold,
                                          "counts": self.stats.snapshot()})

