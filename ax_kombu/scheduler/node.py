"""ax-scheduler: preload → timing wheel → batched claim → Kombu publish, plus recovery.

One node runs its loops each on its own thread, so that no loop waits on
another's I/O. This module is the node's lifecycle: it builds the loops,
registers the node, starts them, and stops them in order. The loops, on the
database clock:

1. **Preload** (:mod:`~ax_kombu.scheduler.housekeeper`): this node's share of
   the tasks due within ``preload_window_ms`` is read into memory (a read: the
   rows are not written), periodically and at once on a producer's wake-up;
   memory is bounded by the window and ``max_loaded``.
2. **Timing wheel** (:mod:`~ax_kombu.scheduler.timing`; the thread that calls
   :meth:`Scheduler.run`): an 8 s millisecond wheel in front of a delay
   queue; due ids fire ``claim_lead_ms`` early (with those due within
   ``claim_window_ms`` after them), in trigger order, as a slot lookup. It
   reads the clock locally and never waits on the database or the broker.
3. **Claim** (:mod:`~ax_kombu.scheduler.claimer`): the ids fired while the
   previous claim ran are claimed with one conditional statement; a row moves
   to DISPATCHING for exactly one node, with a new attempt number, and the
   claim is durable before anything is handed on.
4. **Publish** (:mod:`~ax_kombu.scheduler.dispatcher`; overlaps the next
   claim): each claimed batch at once, up to ``claim_lead_ms`` ahead (the claim lead)
   (a worker starts each task at its trigger time, never before), to the
   queue of its priority, with publisher confirms on RabbitMQ. A batch that does not
   certainly reach the broker goes back to READY; the claimer stops claiming
   until the broker answers again, then they go out with a new attempt.
5. **Recovery** (:mod:`~ax_kombu.scheduler.housekeeper`): every heartbeat,
   a dead worker's RUNNING tasks are retried or failed; every
   ``recovery_interval_s``, unacknowledged dispatches go back to READY and the
   RUNNING tasks of workers not alive are recovered.
   A housekeeping step that fails is logged, counted and backed off alone.
6. **Heartbeat** (:mod:`~ax_kombu.scheduler.heart`): on a thread and a database
   connection of its own, so no housekeeping step, failing or slow, delays a beat.

The loops meet only at mailboxes (:class:`~ax_kombu.scheduler.loop.Mailbox`,
a deque plus an event, each read by one loop): ids for the wheel (read by
the timing loop alone, which alone touches the wheel), fired ids (read by the
claimer alone), and claimed rows (the dispatcher's inbox).

Guarantees:

* **Exactly-once dispatch per attempt**: only the node whose claim moved the
  row publishes it, and a worker runs a message only if its attempt is the
  row's current one.
* **Nothing lost**: a task is always in the database in a state some node
  acts on. The preload writes nothing: the live schedulers split the claimable
  tasks between them by id (:mod:`ax_kombu.store.recovery`), so if a node is
  killed (even ``kill -9``) its share is read by the others once its heartbeat
  is ``heartbeat_misses × heartbeat_interval_s`` old (+ one preload round), and
  at once after a clean stop (it wakes them); meanwhile they take each of its
  tasks once it is overdue (the housekeeper's strays: about two preload intervals
  for the first, then half a second). A claimed-but-unpublished batch
  returns at once if the node is restarted under the same name (a new
  incarnation takes over what the old one claimed: :mod:`ax_kombu.store.nodes`),
  else via the ack timeout.
* **Fenced**: a node told by its heartbeat that it was declared dead drops
  what it has loaded and registers anew; it publishes a claimed batch only while
  its lease (its last landed beat, :class:`~ax_kombu.core.lease.Lease`)
  covers the incarnation that claimed it, so a node paused past its silence
  window publishes none of the claims it lost meanwhile
  (:mod:`~ax_kombu.scheduler.dispatcher`); a node just back from a database outage
  judges no one dead until its own beats have landed for a whole window
  (:mod:`~ax_kombu.scheduler.liveness`).
* **Supervised**: if any of the node's threads dies, the node stops cold and
  :meth:`Scheduler.run` returns :data:`~ax_kombu.node.supervision.EXIT_CRASHED`.
* **Execution is at-least-once**: a re-dispatched task may run twice if the
  first worker did run it (see :mod:`ax_kombu.worker.node`).

Signals (installed by the CLI; the handler only calls
:meth:`Scheduler.request_stop`, which sets a flag and wakes the timing loop):
the first TERM/INT is a warm stop — stop claiming, publish what is claimed,
leave the rest to the other nodes, exit 0. A second one (or a QUIT) is a cold
stop: exit now; claimed-but-unpublished tasks come back through the ack
timeout. The timing loop acts on the flag: :meth:`Scheduler.shutdown` stops
the node's steps in the reverse of their start order (:meth:`Scheduler.steps`,
one list): the housekeeper, claimer and retention loops, waited for together,
then (warm only) the dispatcher's queue, the heart, and a goodbye (the node's
row is marked stopped and the other schedulers woken: their next preload reads
the share this node had). A stop turning cold ends every wait.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

from ax_kombu.config import Settings
from ax_kombu.core.ids import ReservedIds
from ax_kombu.core.lease import Lease
from ax_kombu.core.wheel import TriggerTimer
from ax_kombu.node.steps import Blueprint, Call, Step
from ax_kombu.node.supervision import EXIT_CRASHED, CrashFlag, watch_threads
from ax_kombu.observability.probes import Probe, watch_beats
from ax_kombu.scheduler.alerting import alerting_step
from ax_kombu.scheduler.claimer import Claimer
from ax_kombu.scheduler.dispatcher import Dispatcher, OnPublished
from ax_kombu.scheduler.heart import Heart
from ax_kombu.scheduler.housekeeper import Housekeeper
from ax_kombu.scheduler.loop import Mailbox
from ax_kombu.scheduler.recurrence import Materialiser
from ax_kombu.scheduler.registration import Registration, StoppedEarly
from ax_kombu.scheduler.retention import Retention
from ax_kombu.scheduler.timing import TimingLoop
from ax_kombu.store import Store, nodes
from ax_kombu.store.engine import make_engine
from ax_kombu.store.leases import StoreReserver
from ax_kombu.store.pauses import PauseWatch

log = logging.getLogger(__name__)


class Scheduler:
    """One scheduler node. ``run()`` until :meth:`request_stop`.

    ``run()`` starts the node's steps in order (:meth:`steps`: register, then the heart,
    dispatcher, claimer, housekeeper and retention loops), runs the timing loop on the
    calling thread, and on the way out stops the steps in reverse (:meth:`shutdown`).

    Args:
        settings: the node's settings.
        node_id: the node's name; a unique one is made up if not given.
        on_published: ``on_published(messages, at_ms)`` is told of every batch
            that reached the broker (on the dispatcher's thread), after the hooks.
        publish_hooks: makers of more such hooks, each given the node's store (the
            Celery hand-off, :class:`ax_kombu.celery.handoff.CeleryHandOff`, which
            ``ax-scheduler`` installs), called first, in order.
    """

    def __init__(self, settings: Settings, node_id: str | None = None, *,
                 on_published: OnPublished | None = None,
                 publish_hooks: Sequence[Callable[[Store], OnPublished]] = ()) -> None:
        self.settings = settings
        self.store = Store(settings)
        self.node_id = node_id or nodes.default_node_id("scheduler")
        # the heartbeat writes through an engine of its own: no other loop can delay it
        self._beat_engine = make_engine(settings.database_url, pool_size=1)
        self.heartbeat = nodes.Heartbeat(self.store, self.node_id, "scheduler",
                                         silence_ms=settings.silence_ms,
                                         engine=self._beat_engine)
        self.crash = CrashFlag()
        # a landed beat proves the incarnation live for a while; publishing needs it
        self.lease = Lease(settings.lease_s)
        fired: Mailbox[int] = Mailbox()
        self.timing = TimingLoop(settings, self.store.clock, fired)
        hooks = [make(self.store) for make in publish_hooks]
        if on_published is not None:
            hooks.append(on_published)
        self.dispatcher = Dispatcher(settings, self.store, self.node_id, self.timing.retry_later,
                                     hooks, self.lease)
        self.ids = ReservedIds(StoreReserver(self.store.engine), f"{self.node_id}:{os.getpid()}",
                             settings.id_reservation_s * 1000, self.store.now_ms)
        paused = PauseWatch()  # read by the housekeeper's preload, honoured by the claim
        self.claimer = Claimer(settings, self.store, self.node_id, fired, self.timing,
                               self.dispatcher, self.ids, self.lease, paused)
        self.housekeeper = Housekeeper(settings, self.store, self.heartbeat, self.timing,
                                       self._info, self._fenced,
                                       Materialiser(settings, self.store, self.ids,
                                                    self.node_id), paused)
        self.heart = Heart(self.housekeeper.liveness, self.heartbeat, settings.heartbeat_interval_s,
                           self.store.clock.local_ms, self.lease, self._info)
        self.retention = Retention(settings, self.store)  # AX_RETENTION; idle when off
        self._stop: str | None = None
        self.registration = Registration(
            store=self.store, timing=self.timing, lifecycle=self.heart.lifecycle,
            heartbeat=self.heartbeat, ids=self.ids, node_id=self.node_id,
            stopping=lambda: self._stop is not None)
        self.blueprint = Blueprint("scheduler", self.steps())
        #: /healthz and /readyz (served on the metrics port): beating, registered, claiming
        self.probe = Probe()
        watch_beats(self.probe, self.heart.lifecycle, settings.silence_ms / 1000.0)
        self.probe.ready("claiming", self._claiming)

    @property
    def timer(self) -> TriggerTimer[int]:
        """The timing loop's wheel (read its sizes only; the loop alone changes it)."""
        return self.timing.timer

    @property
    def stopping(self) -> str | None:
        """``"warm"`` or ``"cold"`` once a stop was requested, else None."""
        return self._stop

    # -- control -------------------------------------------------------------------------

    def wake(self) -> None:
        """Preload now (a producer wrote a task due soon)."""
        self.housekeeper.wake()

    def request_stop(self, cold: bool = False) -> None:
        """Warm stop (or cold, if ``cold`` or already stopping). Safe from a signal handler:
        it sets a flag and wakes the timing loop, which stops the other loops."""
        self._stop = "cold" if cold or self._stop else "warm"
        self.timing.stop()

    # -- running -------------------------------------------------------------------------

    def run(self) -> int:
        """Start, run the timing loop until a stop, shut down; returns the exit code.

        0 after a stop, :data:`~ax_kombu.node.supervision.EXIT_CRASHED` if one of the
        node's threads died (the node then stops cold).

        Raises:
            NodeNameInUse: another live process has this node's name.
        """
        undo = watch_threads(self._crashed)
        try:
            if not self.start():
                return 0
            try:
                self.timing.run()
            finally:
                self.shutdown()
        finally:
            undo()
        return EXIT_CRASHED if self.crash.crashed else 0

    def _crashed(self, thread: str, error: BaseException) -> None:
        self.crash(thread, error)
        self.request_stop(cold=True)

    def run_once(self) -> None:
        """One pass of the timing loop (see :meth:`TimingLoop.run_once`)."""
        self.timing.run_once()

    def start(self) -> bool:
        """Start the steps in order (:meth:`steps`): wait for the database (logging, backing
        off), register, start the loops. A step that fails stops those started and raises.

        Returns False if a stop was requested before the database answered.
        """
        try:
            self.blueprint.start()
        except StoppedEarly:
            return False
        log.info("scheduler started", extra={"node": self.node_id})
        return True

    def steps(self) -> list[Step]:
        """The node's steps in start order; :meth:`shutdown` stops them in reverse.

        Read from the bottom, that is the stop: the retention, housekeeper and claimer
        loops are asked to end together (each step only sets a flag), then ``loops ended``
        waits for all three, so the dispatcher's last batch is after the last claim and
        nothing claimed is left unpublished; the dispatcher publishes what it has (a warm
        stop only); the heart beats until then (the node is alive while it finishes); then
        the node deregisters and the store closes. The timing loop is not a step: it runs
        on the thread that calls :meth:`run`, between the start and the stop.
        """
        return [
            Call("store", stop=self._close_store),
            self.registration,
            Call("broker probe", self._probe),
            Call("heart", self.heart.start, self._stop_heart),
            Call("dispatcher", self.dispatcher.start, self._drain_dispatcher),
            Call("loops ended", stop=self._join_loops),
            Call("claimer", self.claimer.start, self.claimer.stop),
            Call("housekeeper", self.housekeeper.start, self.housekeeper.stop),
            Call("retention", self.retention.start, self.retention.stop),
            alerting_step(self.settings, self.store),  # per-type alerts (ax_kombu.alerts)
        ]

    def _probe(self) -> None:
        """Try the broker once (a failure is logged; the dispatcher keeps trying)."""
        self.dispatcher.probe()

    def _claiming(self) -> tuple[bool, str]:
        """The readiness check: the claimer runs and the broker answers."""
        if self._stop is not None:
            return False, f"stopping ({self._stop})"
        if not self.claimer.is_alive():
            return False, "the claimer is not running"
        if not self.dispatcher.broker_ok.is_set():
            return False, "not claiming: the broker is unreachable"
        return True, "claiming"

    def _fenced(self) -> None:
        """Declared dead: publish nothing more under this incarnation, drop the wheel."""
        self.lease.revoke()
        self.timing.drop_all()

    def _info(self) -> dict[str, Any]:
        """What the heartbeat publishes about this node."""
        timer = self.timing.timer
        return {"loaded": len(timer), "due": self.claimer.due,
                "wheel": timer.wheel_depth, "delay_queue": timer.delayed_depth,
                "clock_offset_ms": round(self.store.clock.offset_ms, 1),
                "published": self.dispatcher.published}

    # -- stopping ------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Finish: stop the started steps in reverse (:meth:`steps`): publish what is
        claimed (unless cold), say goodbye."""
        self.blueprint.stop()

    def _join_loops(self) -> None:
        """Wait for the claimer, housekeeper and retention loops (asked to end together)."""
        self._join(self.housekeeper)
        self._join(self.claimer)
        self._join(self.retention)

    def _drain_dispatcher(self) -> None:
        """A warm stop: the dispatcher publishes its inbox, then ends; a cold one leaves it."""
        if self._stop != "cold" and self.dispatcher.is_alive():
            self.dispatcher.inbox.put(None)
            self._join(self.dispatcher)

    def _stop_heart(self) -> None:
        self.heart.stop()
        if self.heart.is_alive():
            self.heart.join(timeout=5.0)

    def _close_store(self) -> None:
        self.store.close()
        self._beat_engine.dispose()

    def _join(self, thread: threading.Thread) -> None:
        """Wait for ``thread`` unless (or until) the stop turns cold."""
        while thread.is_alive() and self._stop != "cold":
            thread.join(timeout=0.2)
