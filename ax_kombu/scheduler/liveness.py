"""Who is alive, for one scheduler node: its own heartbeat, fencing, and judging the others.

Contracts:

* **Fenced heartbeat.** Each beat is a compare-and-set on this process's live
  incarnation (:class:`ax_kombu.store.nodes.Heartbeat`). When a beat finds the
  incarnation declared dead, the node stops acting under it at once: it drops
  every task it has loaded (``on_fenced``; its next preload reads its whole
  share again), then registers a new incarnation, which puts back what the old one
  claimed and never published. If
  another live process has taken the name meanwhile, registering raises
  :class:`~ax_kombu.exceptions.NodeNameInUse` and the node stops (its thread
  is supervised: the process exits non-zero).
* **No judging after being cut off.** Declaring other nodes dead — and every
  recovery that rests on "that node is not alive" — happens only while this
  node's own heartbeats have been succeeding for a whole silence window
  (``heartbeat_misses × heartbeat_interval_s``). A node just back from a
  database outage (or just started) has not seen the others' beats land yet,
  so it waits a window first: an outage of the database kills nobody.
* **Bounded re-dispatch** (the slow recovery scan): DISPATCHING tasks no worker
  started go out again with a doubling ack timeout, at most
  ``max_dispatches`` times, and only for queues some live worker consumes
  (:func:`ax_kombu.store.recovery.redispatch_unacked`).
* **A backlog is not a loss.** A queue that still holds messages may still hold
  the one a DISPATCHING task waits for: its tasks are not dispatched again
  while the broker says the queue is not empty (nor while the broker cannot be
  asked). Only once the queue has drained is a task still DISPATCHING past its
  ack timeout known lost (its worker popped it and died before its RUNNING
  move, or the broker lost its data; RabbitMQ puts a dead consumer's unacked
  messages back in the queue by itself), and sent again. Under a backlog that
  takes minutes to drain, no task is sent twice and none is failed as "never
  started".
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from sqlalchemy import Connection, text

from ax_kombu.broker.connection import backlogged
from ax_kombu.config import PRIORITIES, Settings
from ax_kombu.observability import metrics
from ax_kombu.store import Store, gates, nodes, recovery

log = logging.getLogger(__name__)

#: how long judging waits for a node row or task row locked by another transaction
JUDGE_LOCK_TIMEOUT_MS = 2000


class Liveness:
    """Heartbeats this node and recovers the tasks of dead ones.

    Args:
        settings: heartbeat, ack-timeout and re-dispatch settings.
        store: the task store.
        heartbeat: this node's registration (registered before the first beat).
        info: what the heartbeat publishes about the node.
        on_fenced: drops every task the node has loaded.
        wake: asks for a preload (recovery freed tasks).
    """

    def __init__(self, settings: Settings, store: Store, heartbeat: nodes.Heartbeat,
                 info: Callable[[], dict[str, Any]], on_fenced: Callable[[], None],
                 wake: Callable[[], None]) -> None:
        self._settings = settings
        self._store = store
        self._heartbeat = heartbeat
        self._info = info
        self._on_fenced = on_fenced
        self._wake = wake
        self.silence_ms = settings.silence_ms
        #: database time since which this node's beats have all succeeded (None: not now)
        self._beating_since: int | None = None

    def database_failed(self) -> None:
        """A database call failed: this node may be cut off, so it stops judging others."""
        self._beating_since = None

    def trusted(self, now: int) -> bool:
        """Whether this node may judge others dead (see the module docstring)."""
        return self._beating_since is not None and now - self._beating_since >= self.silence_ms

    def landed(self, now: int) -> None:
        """A beat landed (:mod:`ax_kombu.scheduler.heart`; a failed one calls
        :meth:`database_failed`)."""
        if self._beating_since is None:
            self._beating_since = now

    def judge(self, now: int) -> None:
        """If trusted, declare silent nodes dead and recover their tasks (housekeeper)."""
        if self.trusted(now):
            self._judge(now)

    def fenced(self) -> None:
        """This node was declared dead: drop every task it keeps in memory (called by its
        :class:`~ax_kombu.node.lifecycle.NodeLifecycle` before it registers anew)."""
        self._on_fenced()

    def registered(self, now: int) -> None:
        """Registered anew after being fenced: its beats count from now; preload again."""
        self._beating_since = now
        self._wake()

    def _judge(self, now: int) -> None:
        with self._store.engine.begin() as conn:
            if conn.dialect.name == "postgresql":
                # a row locked by a cut-off node's orphaned transaction fails this pass
                # (retried after the step's back-off) instead of stopping the housekeeper
                conn.execute(text(f"SET LOCAL lock_timeout = '{JUDGE_LOCK_TIMEOUT_MS}ms'"))
            dead = nodes.claim_dead(conn, self.silence_ms)
            recovered = recovery.recover_running(conn, dead, now)
            if recovered:  # a gated run ended with its worker: wake what waited on it
                gates.wake_stranded(conn)
            resent = gates.retarget(conn, dead)
        if resent:
            log.warning("shards sent to dead workers go to other workers",
                        extra={"nodes": dead, "shards": len(resent)})
        if dead:
            log.warning("nodes stopped heartbeating; recovering their tasks",
                        extra={"nodes": dead, "running": len(recovered)})
            metrics.recovered_total.labels("running").inc(len(recovered))
            self._wake()

    def recover(self, now: int) -> None:
        """The slow scan: unacked dispatches, orphaned running tasks, stranded parked ones."""
        if not self.trusted(now):
            return
        silent_since = now - self.silence_ms
        with self._store.engine.connect() as conn:
            consumed = self._consumed(conn)
        backlog = backlogged(self._settings, consumed)  # before the transaction: a round trip
        drained = [] if backlog is None else [p for p in consumed if p not in backlog]
        with self._store.engine.begin() as conn:
            unacked = recovery.redispatch_unacked(
                conn, now, self._settings.ack_timeout_ms, drained,
                self._settings.max_dispatches)
            idle = recovery.waiting_without_consumer(
                conn, [p for p in PRIORITIES if p not in consumed])
            running = recovery.recover_orphan_running(conn, now, silent_since)
            stranded = gates.wake_stranded(conn)
        for priority in PRIORITIES:
            metrics.queue_waiting_without_consumer.labels(priority).set(idle.get(priority, 0))
        if stranded:
            log.info("woke parked tasks whose key or limit had room", extra={"woken": stranded})
        if unacked or running:
            gave_up = sum(1 for _, status in unacked if status == "FAILED")
            log.warning("recovery found tasks to dispatch again",
                        extra={"ack_timeouts": len(unacked) - gave_up, "gave_up": gave_up,
                               "running": len(running)})
            metrics.ack_timeout_total.inc(len(unacked) - gave_up)
            metrics.redispatch_failed_total.inc(gave_up)
            metrics.recovered_total.labels("running").inc(len(running))
            self._wake()

    def _consumed(self, conn: Connection) -> list[str]:
        """The priorities whose queue some live worker consumes."""
        queues = nodes.consumed_queues(conn, self.silence_ms)
        return [p for p in PRIORITIES if self._settings.queue_for(p) in queues]
