"""The ax-worker node: receive → RUNNING → run → record → ack, one bounded pool per queue.

:class:`Worker` builds the parts and lists them as steps (:mod:`ax_kombu.node.steps`):
:meth:`Worker.steps` is the start order, and the stop order is its reverse. The consuming
thread (:mod:`~ax_kombu.worker.consumer`) runs between the two. The parts, each in its
module:

* :mod:`~ax_kombu.worker.consumer` — the broker connection (one consuming thread owns it),
  a Kombu consumer per lane or the Redis puller, reconnects;
* :mod:`~ax_kombu.worker.intake` — plans what arrived into the lanes
  (:mod:`~ax_kombu.worker.planning`, :mod:`~ax_kombu.worker.receipts`), starts runs in the
  pools (:mod:`~ax_kombu.worker.starts`), acks what has ended
  (:mod:`~ax_kombu.worker.acks`); each run has one state (:mod:`~ax_kombu.worker.run`);
* :mod:`~ax_kombu.worker.results` — writes each run's outcome, in batches;
* :mod:`~ax_kombu.worker.listing` — which waiting runs certainly have not started;
* :mod:`~ax_kombu.worker.shutdown` — hands unstarted work back, lets runs finish;
* the node lifecycle (:mod:`ax_kombu.node.lifecycle`) — registration, heartbeats, lease.

Guarantees:

* Execution is at-least-once. A task runs only after its RUNNING move committed, and only
  for the attempt in its message; its message is acked only after that move committed.
* ``kill -9``: started tasks stay RUNNING with this worker as their owner node; once its
  heartbeat stops, a scheduler recovers them (retry, or FAILED "worker lost"); RabbitMQ
  hands their unacked messages to another worker, which refuses them (the task is not
  DISPATCHING). Received but unstarted tasks are still DISPATCHING: RabbitMQ redelivers
  them, or the scheduler's ack timeout dispatches them again. That is why Redis's ack
  emulation is turned off here: the database covers its window.
* Warm shutdown (first SIGTERM/SIGINT, :meth:`Worker.request_stop`): stop consuming; hand
  received-but-unstarted work back to READY; let running tasks finish within
  ``worker_grace_s``; record the rest as abandoned (a failure that may retry); write every
  result; mark the heartbeat stopped; exit 0. Cold shutdown (a second signal, or
  SIGQUIT): the same without waiting for running tasks; exit 1.
* Quiet (SIGTSTP, or ``ax workers quiet``, :meth:`Worker.request_quiet`): stop consuming,
  hand received and staged work back, let running tasks finish, keep heartbeating;
  ``ax workers resume`` consumes again (:mod:`~ax_kombu.worker.quiet`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from kombu import Queue
from sqlalchemy.exc import SQLAlchemyError

from ax_kombu.broker.connection import queue_arguments, task_queues
from ax_kombu.config import PRIORITIES, Settings, redact_url, worker_queue
from ax_kombu.core.lease import Lease
from ax_kombu.exceptions import StoreError
from ax_kombu.node.lifecycle import NodeLifecycle
from ax_kombu.node.steps import Blueprint, Call, Job, Step, Timers
from ax_kombu.node.supervision import EXIT_CRASHED, CrashFlag, watch_threads
from ax_kombu.observability.probes import Probe, watch_beats
from ax_kombu.store import Store
from ax_kombu.store.engine import make_engine
from ax_kombu.store.nodes import Heartbeat, default_node_id
from ax_kombu.worker.consumer import Consumer
from ax_kombu.worker.control import StopFlags, Wakeup
from ax_kombu.worker.counters import Counters
from ax_kombu.worker.housekeeping import WATCH_S, Housekeeping
from ax_kombu.worker.intake import Intake
from ax_kombu.worker.lanes import OWN_LANE, Lane, parse_queues
from ax_kombu.worker.listing import SCAN_S, Listing, ListingScan
from ax_kombu.worker.processors import Resolver, split_names
from ax_kombu.worker.receipts import ReceiptWriter
from ax_kombu.worker.results import ResultWriter
from ax_kombu.worker.scopes import run_scopes
from ax_kombu.worker.shutdown import Shutdown

log = logging.getLogger(__name__)


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
                                             settings.callback_secret,
                                             settings.callback_signing)
        self.stats = Counters()
        self.results = ResultWriter(self.store, settings, self.stats, node=self.node_id)
        self.heartbeat = Heartbeat(self.store, self.node_id, "worker",
                                   silence_ms=settings.silence_ms)
        # which RUNNING tasks certainly have not started, written on a connection of its own
        self._listing_engine = make_engine(settings.database_url, pool_size=1)
        self.listing = Listing(self.heartbeat, self._listing_engine)
        self.crash = CrashFlag()
        self.flags = StopFlags()
        wakeup = self._wakeup = Wakeup()
        self.lanes = self._lanes(settings, queues, self.node_id, wakeup)
        #: set while consuming (tests wait for it)
        self.ready = threading.Event()
        self.receipts = ReceiptWriter(self.store, self.node_id, wakeup.poke,
                                      lambda: self.flags.stopping,
                                      settings.worker_receipt_writers,
                                      lambda: self.heartbeat.incarnation)
        # a beat proves the incarnation live for a while; starting a staged run needs it
        self.lease = Lease(settings.lease_s)
        self.intake = self._intake(wakeup)
        self.shutdown = Shutdown(settings, self.store, self.intake, self.stats, wakeup,
                                 self.flags)
        self.consumer = Consumer(settings, self.lanes, intake=self.intake,
                                 shutdown=self.shutdown, stats=self.stats, wakeup=wakeup,
                                 flags=self.flags, ready=self.ready)
        self.lifecycle = NodeLifecycle(self.heartbeat, self.lease, self.info,
                                       keep_running=self.intake.stage.begun,
                                       on_refused=self._declared_dead)
        self.housekeeping = Housekeeping(
            engine=self.store.engine, clock=self.store.clock, lanes=self.lanes,
            stage=self.intake.stage, starter=self.intake.starter, shutdown=self.shutdown,
            node=self.node_id)
        self.blueprint = Blueprint("worker", self.steps())
        #: /healthz and /readyz (served on the metrics port): beating, registered, consuming
        self.probe = Probe()
        watch_beats(self.probe, self.lifecycle, settings.silence_ms / 1000.0)
        self.probe.ready("consuming", self._consuming)

    def _intake(self, wakeup: Wakeup) -> Intake:
        return Intake(self.lanes, receipts=self.receipts, results=self.results,
                      resolver=self.resolver, stats=self.stats, wakeup=wakeup,
                      flags=self.flags, clock=self.store.clock.earliest_ms, lease=self.lease,
                      batch_size=self.settings.worker_batch_size,
                      now_ms=self.store.clock.local_ms,  # the result writer's clock too
                      listing=self.listing, scopes=run_scopes(self.settings))

    @staticmethod
    def _lanes(settings: Settings, queues: Sequence[str], node_id: str,
               wakeup: Wakeup) -> list[Lane]:
        """A lane per priority consumed, and one for the worker's own queue (what is sent
        to it alone, a shard of shards="workers"; RabbitMQ drops the queue a day after its
        worker is last seen)."""
        broker_queues = task_queues(settings)
        horizon_s = settings.worker_stage_horizon_ms / 1000.0
        lanes = [Lane(p, broker_queues[p], settings.pool_size(p), settings.prefetch_multiplier,
                      wakeup.poke, horizon_s, threads_max=settings.lane_threads_max)
                 for p in parse_queues(queues, settings)]
        own = worker_queue(node_id)
        lanes.append(Lane(OWN_LANE, Queue(own, routing_key=own, durable=True, expires=86_400.0,
                                          queue_arguments=queue_arguments(settings) or None),
                          settings.pool_own, settings.prefetch_multiplier, wakeup.poke,
                          horizon_s))
        return lanes

    def steps(self) -> list[Step]:
        """The worker's steps in start order; they stop in the reverse order. So the
        listing stops after the pools (a thread may wait for a release until its pool
        closes), the registration is marked stopped after the last result is written,
        and the store closes last."""
        beat_s = self.settings.heartbeat_interval_s
        house = self.housekeeping
        return [
            Call("store", stop=self.store.close),
            Call("stop connection", stop=self.shutdown.close),
            Call("receipts", stop=self.receipts.close),
            Call("listing", start=self.listing.start, stop=self._stop_listing),
            Call("event loop", stop=self.intake.starter.stop),  # after the pools
            Call("pools", stop=self._close_pools),
            Call("registration", start=self._register, stop=self._unregister),
            Timers("housekeeping", [
                Job("cancelled runs", beat_s, house.signal_cancelled),
                Job("waits about to end", WATCH_S, house.watch_waiting, logging.DEBUG),
                Job("expired waits", beat_s, house.hand_back_expired),
                Job("pool gauges", beat_s, house.pool_gauges),
                Job("listing scan", SCAN_S, ListingScan(self.intake.stage, self.lanes,
                                                        self.listing))],
                tolerated=(SQLAlchemyError,), final=house.hand_back_expired),
            Timers("heartbeat", [Job("beat", beat_s, self._beat)]),
            Call("results", start=self.results.start, stop=self._stop_results),
            Call("runs", stop=lambda: self.shutdown.finish_running(connected=False)),
        ]

    # -- control (safe from signal handlers: they only set flags) ------------------------------

    def request_stop(self, cold: bool = False) -> None:
        """Warm stop; cold if ``cold`` or if a stop was already requested."""
        self.flags.request(cold)

    def request_quiet(self) -> None:
        """Stop taking new work (:mod:`~ax_kombu.worker.quiet`); only sets a flag."""
        self.consumer.quiet.request()

    @property
    def stopping(self) -> bool:
        """A stop was requested."""
        return self.flags.stopping

    @property
    def cold(self) -> bool:
        """The stop requested is cold (running tasks are not waited for)."""
        return self.flags.cold

    def _consuming(self) -> tuple[bool, str]:
        """The readiness check: connected to the broker and consuming, not stopping."""
        if self.flags.stopping:
            return False, "stopping (cold)" if self.flags.cold else "stopping (warm)"
        if not self.ready.is_set():
            return False, "not consuming: connecting to the broker"
        if self.consumer.quiet.active:  # asked for: drained, not broken
            return True, "quiet: takes no new work until resumed"
        return True, "consuming"

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
                "quiet": self.consumer.quiet.active,
                "counts": self.stats.snapshot()}

    # -- lifecycle -----------------------------------------------------------------------------

    def run(self) -> int:
        """Start the steps, consume until stopped (on the calling thread), stop the steps;
        returns the exit code.

        0 after a warm stop, 1 after a cold one, and
        :data:`~ax_kombu.node.supervision.EXIT_CRASHED` if one of the worker's threads
        died (it then stops cold).

        Raises:
            StoreError: the store cannot be reached at start.
            NodeNameInUse: another live process has this worker's name.
        """
        undo = watch_threads(self._crashed)
        try:
            self.blueprint.start()
            try:
                self.consumer.run()
            finally:
                self.blueprint.stop()
        finally:
            undo()
        log.info("worker stopped", extra={"node": self.node_id, "cold": self.flags.cold,
                                          "counts": self.stats.snapshot()})
        if self.crash.crashed:
            return EXIT_CRASHED
        return 1 if self.flags.cold else 0

    def _crashed(self, thread: str, error: BaseException) -> None:
        self.crash(thread, error)
        self.request_stop(cold=True)
        self._wakeup.poke()

    def _register(self) -> None:
        """The registration step: this process becomes the live incarnation of its name."""
        try:
            took = self.lifecycle.register()
        except SQLAlchemyError as exc:
            raise StoreError(f"cannot reach the store {redact_url(self.settings.database_url)}: "
                             f"{getattr(exc, 'orig', exc)}") from None
        log.info("worker started", extra={"node": self.node_id,
                                          "broker": redact_url(self.settings.broker_url),
                                          "queues": [lane.queue.name for lane in self.lanes],
                                          "recovered_from_earlier_run": took.running})

    def _beat(self) -> None:
        """One beat; it carries a quiet asked by signal, and reads back the row's quiet."""
        quiet = self.consumer.quiet
        quiet.before_beat(self.heartbeat)
        quiet.after_beat(self.heartbeat, self.lifecycle.beat())

    def _unregister(self) -> None:
        """Mark the heartbeat stopped (a clean exit)."""
        try:
            self.lifecycle.stop()
        except SQLAlchemyError:
            log.warning("could not mark the heartbeat stopped", exc_info=True)

    def _declared_dead(self) -> None:
        """Declared dead while alive (cut off from the database, or paused past the silence
        window; the lifecycle has revoked the lease): no RUNNING move succeeds under the old
        incarnation (fenced in SQL), no staged run starts (the stage is withdrawn: a
        scheduler may have given those tasks another attempt already; rows still ours go
        back RUNNING → DELAYED at their attempt), running tasks go on, and the lifecycle
        registers anew, keeping what is running. A receipt batch fenced under the old
        incarnation that comes back after this is refused at start (``Lease.covers``)."""
        staged = self.intake.withdraw()
        self.shutdown.hand_back_staged(staged, self.store.engine)  # the heartbeat's thread
        self.intake.starter.wake(staged)
        log.warning("this worker was declared dead; its stage withdrawn",
                    extra={"node": self.node_id, "withdrawn": len(staged)})

    def _stop_results(self) -> None:
        if not self.results.stop(self.settings.worker_grace_s + 5.0):
            log.error("not every result could be written before exit")

    def _close_pools(self) -> None:
        for lane in self.lanes:
            lane.pool.close()

    def _stop_listing(self) -> None:
        self.listing.stop()
        self._listing_engine.dispose()
