"""The ax-worker node: receive → RUNNING → run → record → ack, one bounded pool per queue.

:class:`Worker` is the lifecycle: it builds the stages, registers the node
and keeps its heartbeat, runs the consuming thread until a stop is
requested, and stops the stages in order. The stages, each in its module:

* :mod:`~ax_kombu.worker.consumer` — the broker connection (one consuming
  thread owns it), a Kombu consumer per lane or the Redis puller, reconnects;
* :mod:`~ax_kombu.worker.intake` — plans what arrived into the lanes
  (:mod:`~ax_kombu.worker.lanes`), sends receipt batches
  (:mod:`~ax_kombu.worker.receipts`), starts runs in the pools
  (:mod:`~ax_kombu.worker.pools`), acks what has ended;
* :mod:`~ax_kombu.worker.results` — writes each run's outcome, in batches;
* :mod:`~ax_kombu.worker.shutdown` — hands unstarted work back, lets runs finish.

Guarantees:

* Execution is at-least-once. A task runs only after its RUNNING move
  committed, and only for the attempt in its message; its message is acked
  only after that move committed.
* ``kill -9``: started tasks stay RUNNING with this worker as
  ``owner_node``; once its heartbeat stops, a scheduler recovers them
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
import threading
import time
from collections.abc import Sequence
from typing import Any

from kombu import Queue
from sqlalchemy.exc import SQLAlchemyError

from ax_kombu.broker.connection import queue_arguments, task_queues
from ax_kombu.config import PRIORITIES, Settings, redact_url, worker_queue
from ax_kombu.core.lease import Lease
from ax_kombu.exceptions import StoreError
from ax_kombu.observability import metrics
from ax_kombu.store import Store
from ax_kombu.store.engine import make_engine
from ax_kombu.store.nodes import Heartbeat, default_node_id
from ax_kombu.store.tasks import cancelled_among
from ax_kombu.supervision import EXIT_CRASHED, CrashFlag, watch_threads
from ax_kombu.worker.consumer import Consumer
from ax_kombu.worker.control import StopFlags, Wakeup
from ax_kombu.worker.counters import Counters
from ax_kombu.worker.holds import Holds
from ax_kombu.worker.intake import Intake
from ax_kombu.worker.lanes import OWN_LANE, Lane, parse_queues
from ax_kombu.worker.processors import Resolver, split_names
from ax_kombu.worker.receipts import ReceiptWriter
from ax_kombu.worker.results import ResultWriter
from ax_kombu.worker.shutdown import Shutdown

log = logging.getLogger(__name__)

#: how often staged runs held before their trigger time are checked for ``ax cancel``
HOLD_WATCH_S = 0.05
#: ...those due within this long only: a run held longer is checked once it is this close
#: (with the 1 s claim lead, checking thousands of held ids every 50 ms cost a tenth of
#: the worker's CPU and a third of a PostgreSQL core before a burst was due)
HOLD_WATCH_AHEAD_MS = 250


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
                                             split_names(settings.callback_allow_hosts),
                                             settings.callback_secret)
        self.stats = Counters()
        self.results = ResultWriter(self.store, settings, self.stats, node=self.node_id)
        self.heartbeat = Heartbeat(self.store, self.node_id, "worker",
                                   silence_ms=settings.silence_ms)
        # which RUNNING tasks certainly have not started, written on a connection of its own
        self._holds_engine = make_engine(settings.database_url, pool_size=1)
        self.holds = Holds(self.heartbeat, self._holds_engine)
        self.crash = CrashFlag()
        self.flags = StopFlags()
        wakeup = self._wakeup = Wakeup()
        broker_queues = task_queues(settings)
        horizon_s = settings.worker_stage_horizon_ms / 1000.0
        self.lanes = [Lane(p, broker_queues[p], settings.pool_size(p),
                           settings.prefetch_multiplier, wakeup.poke, horizon_s)
                      for p in parse_queues(queues, settings)]
        # what is sent to this worker alone (a shard of shards="workers"), in its own pool;
        # RabbitMQ drops the queue a day after its worker is last seen
        own = worker_queue(self.node_id)
        self.lanes.append(Lane(OWN_LANE, Queue(own, routing_key=own, durable=True,
                                               expires=86_400.0,
                                               queue_arguments=queue_arguments(settings)
                                               or None),
                               settings.pool_own, settings.prefetch_multiplier, wakeup.poke,
                               horizon_s))
        #: set while consuming (tests wait for it)
        self.ready = threading.Event()
        self.receipts = ReceiptWriter(self.store, self.node_id, wakeup.poke,
                                      lambda: self.flags.stopping,
                                      settings.worker_receipt_writers,
                                      lambda: self.heartbeat.incarnation)
        # a beat proves the incarnation live for a while; starting a staged run needs it
        self.lease = Lease(settings.lease_s)
        self.intake = Intake(self.lanes, self.receipts, self.results, self.resolver,
                             self.stats, wakeup, self.flags, self.store.clock.earliest_ms,
                             self.lease, settings.worker_batch_size,
                             self.store.clock.local_ms,  # the result writer's clock too
                             self.holds)
        self.holds.scan = self.intake.holdable
        self.shutdown = Shutdown(settings, self.store, self.intake, self.stats, wakeup,
                                 self.flags)
        self.consumer = Consumer(settings, self.lanes, self.intake, self.shutdown, self.stats,
                                 wakeup, self.flags, self.ready)
        self._heart_stop = threading.Event()

    # -- control (safe from signal handlers: they only set flags) ------------------------------

    def request_stop(self, cold: bool = False) -> None:
        """Warm stop; cold if ``cold`` or if a stop was already requested."""
        self.flags.request(cold)

    @property
    def stopping(self) -> bool:
        """A stop was requested."""
        return self.flags.stopping

    @property
    def cold(self) -> bool:
        """The stop requested is cold (running tasks are not waited for)."""
        return self.flags.cold

    def info(self) -> dict[str, Any]:
        """What the heartbeat publishes about this worker."""
        lanes = {lane.priority: lane.info() for lane in self.lanes}
        return {"queues": [lane.queue.name for lane in self.lanes],
                "pools": {p: i["size"] for p, i in lanes.items()},
                "free": {p: i["free"] for p, i in lanes.items()},
                "backlog": {p: i["backlog"] for p, i in lanes.items()},
                "stuck": {p: i["stuck"] for p, i in lanes.items()},
                "overdue": {p: i["overdue"] for p, i in lanes.items()},
                "running": sum(i["running"] for i in lanes.values()),
                "counts": self.stats.snapshot()}

    # -- lifecycle -----------------------------------------------------------------------------

    def run(self) -> int:
        """Consume until stopped (on the calling thread); returns the exit code.

        0 after a warm stop, 1 after a cold one, and
        :data:`~ax_kombu.supervision.EXIT_CRASHED` if one of the worker's threads
        died (it then stops cold).

        Raises:
            StoreError: the store cannot be reached at start.
            NodeNameInUse: another live process has this worker's name.
        """
        try:
            sent = time.monotonic()
            took = self.heartbeat.register(self.info())
            self.lease.confirm(sent, self.heartbeat.incarnation)
        except SQLAlchemyError as exc:
            raise StoreError(f"cannot reach the store {redact_url(self.settings.database_url)}: "
                             f"{getattr(exc, 'orig', exc)}") from None
        undo = watch_threads(self._crashed)
        self.results.start()
        self.holds.start()
        beat = threading.Thread(target=self._beat, name="ax-heartbeat", daemon=True)
        beat.start()
        threading.Thread(target=self._watch_held, name="ax-hold-watch", daemon=True).start()
        log.info("worker started", extra={"node": self.node_id,
                                          "broker": redact_url(self.settings.broker_url),
                                          "queues": [lane.queue.name for lane in self.lanes],
                                          "recovered_from_earlier_run": took.running})
        try:
            self.consumer.run()
        finally:
            self._stop(beat)
            undo()
        if self.crash.crashed:
            return EXIT_CRASHED
        return 1 if self.flags.cold else 0

    def _crashed(self, thread: str, error: BaseException) -> None:
        self.crash(thread, error)
        self.request_stop(cold=True)
        self._wakeup.poke()

    def _beat(self) -> None:
        """Every heartbeat interval: beat (re-registering if declared dead), then signal
        the runs whose task was cancelled meanwhile. A database error skips one beat;
        anything else ends the thread, and the worker with it (supervised)."""
        while not self._heart_stop.wait(self.settings.heartbeat_interval_s):
            try:
                sent = time.monotonic()
                if self.heartbeat.beat(self.info()):
                    self.lease.confirm(sent, self.heartbeat.incarnation)
                else:
                    self._fenced()
                self._signal_cancelled()
                self._hand_back_expired_holds()
                self._pool_gauges()
            except SQLAlchemyError:
                log.warning("heartbeat failed", exc_info=True, extra={"node": self.node_id})

    def _hand_back_expired_holds(self) -> None:
        """Runs whose timeout passed while held never started: their rows go back RUNNING
        → DELAYED at their attempt (no retry counted); if the database fails, the next
        beat tries again (or, once this node is declared dead, the recovery takes them)."""
        expired = self.intake.take_expired_holds()
        if expired and not self.shutdown.hand_back_staged(expired, self.store.engine):
            for delivery in expired:
                self.intake.expired_holds.put(delivery)

    def _pool_gauges(self) -> None:
        """Each lane's pool in the metrics: its slots, those busy, messages held."""
        for lane in self.lanes:
            metrics.pool_size.labels(lane.priority).set(lane.pool.size)
            metrics.pool_busy.labels(lane.priority).set(lane.pool.size - lane.pool.free)
            metrics.pool_prefetched.labels(lane.priority).set(lane.held)

    def _fenced(self) -> None:
        """Declared dead while alive (cut off from the database, or paused past the
        silence window): no RUNNING move succeeds under the old incarnation (fenced in
        SQL), no staged run starts (the lease is revoked, the stage withdrawn: a scheduler
        may have given those tasks another attempt already; rows still ours go back
        RUNNING → DELAYED at their attempt), running tasks go on, and the worker
        registers anew, keeping what it is running. A receipt batch fenced under the old
        incarnation that comes back after this is refused at start (``Lease.covers``)."""
        self.lease.revoke()
        staged = self.intake.withdraw_staged()
        self.shutdown.hand_back_staged(staged, self.store.engine)  # the heartbeat's thread
        self.intake.wake(staged)
        running = [d.task.task_id for d in list(self.intake.running) if d.started]
        log.warning("this worker was declared dead; registering anew",
                    extra={"node": self.node_id, "running": len(running),
                           "withdrawn": len(staged)})
        metrics.fenced_total.inc()
        sent = time.monotonic()
        self.heartbeat.register(self.info(), keep_running=running)
        self.lease.confirm(sent, self.heartbeat.incarnation)

    def _signal_cancelled(self, held_only: bool = False) -> None:
        """Set the cancellation signal of runs whose task was cancelled (``ax cancel``).

        Args:
            held_only: only staged runs held before a trigger time that is at most
                ``HOLD_WATCH_AHEAD_MS`` away.
        """
        if held_only:
            now = self.store.clock.local_ms()
            if self.intake.latest_trigger <= now:
                return  # nothing is held (in a burst, thousands wait for a thread, not a time)
            deliveries = [d for d in list(self.intake.running)
                          if now < d.task.trigger_time <= now + HOLD_WATCH_AHEAD_MS]
        else:
            deliveries = list(self.intake.running)
        running = {d.task.task_id: d for d in deliveries}
        if not running:
            return
        with self.store.engine.connect() as conn:
            cancelled = cancelled_among(conn, list(running))
        self.intake.wake([running[task_id] for task_id in cancelled], "cancelled")

    def _watch_held(self) -> None:
        """Every HOLD_WATCH_S while staged runs are held: signal those cancelled meanwhile,
        so that ``ax cancel`` up to about that long before a trigger time stops the run
        before it starts (one query for all of them; none while nothing is held)."""
        while not self._heart_stop.wait(HOLD_WATCH_S):
            try:
                self._signal_cancelled(held_only=True)
            except SQLAlchemyError:
                log.debug("cancellation check of held runs failed", exc_info=True)

    def _stop(self, beat: threading.Thread) -> None:
        """The shutdown order: runs end (or are abandoned), results written, heartbeat
        marked stopped, then threads and connections closed."""
        self.shutdown.finish_running(connected=False)
        if not self.results.stop(self.settings.worker_grace_s + 5.0):
            log.error("not every result could be written before exit")
        self._heart_stop.set()
        beat.join(5.0)
        self._hand_back_expired_holds()
        try:
            self.heartbeat.stop()
        except SQLAlchemyError:
            log.warning("could not mark the heartbeat stopped", exc_info=True)
        for lane in self.lanes:
            lane.pool.close()
        self.holds.stop()
        self._holds_engine.dispose()
        self.receipts.close()
        self.shutdown.close()
        self.store.close()
        log.info("worker stopped", extra={"node": self.node_id, "cold": self.flags.cold,
                                          "counts": self.stats.snapshot()})
