"""ax-scheduler: preload → timing wheel → batched claim → Kombu publish, plus recovery.

One loop per node, on the database clock:

1. **Preload** (every ``preload_interval_ms``, at once on a producer's
   wake-up, and again straight away while it keeps finding full batches):
   takes tasks due within ``preload_window_ms`` into memory — CREATED rows
   and rows nobody holds (:mod:`ax_kombu.store.scan`). Memory is bounded by
   the window and ``max_held``, never by how many future tasks exist.
2. **Timing wheel** (:class:`ax_kombu.wheel.TriggerTimer`): an 8 s
   millisecond wheel in front of a delay queue for the rest of the window.
   Due ids come out in trigger order; firing is a slot lookup.
3. **Claim**: due ids are claimed in batches of ``claim_batch`` with one
   conditional statement each (:func:`ax_kombu.states.claim`: PostgreSQL
   ``FOR UPDATE SKIP LOCKED`` + ``UPDATE … RETURNING``). Why claim rather
   than partition: any node may end up holding any task (adoption after a
   node dies), and the database stays the one arbiter — a row moves to
   DISPATCHING for exactly one node, with a new attempt number.
4. **Publish**, on a second thread (:class:`Dispatcher`) so the next claim
   overlaps this publish: Kombu, to the queue of the task's priority, with
   publisher confirms on RabbitMQ. A batch that does not certainly reach the
   broker goes back to READY (compare-and-set from DISPATCHING); the loop
   stops claiming until the broker answers again, then they go out with a
   new attempt.
5. **Recovery**: every heartbeat the node looks for dead nodes (no heartbeat
   for ``heartbeat_misses`` intervals): their held tasks are released (and
   adopted by the next preload anywhere) and a dead worker's RUNNING tasks
   are retried or failed. Every ``recovery_interval_s``: DISPATCHING tasks
   older than ``ack_timeout_ms`` go back to READY, and due tasks held by
   nobody alive are released.

Guarantees:

* **Exactly-once dispatch per attempt**: only the node whose claim moved the
  row publishes it, and a worker runs a message only if its attempt is the
  row's current one.
* **Nothing lost**: a task is always in the database in a state some node
  acts on. If a node is killed (even ``kill -9``), its held tasks are adopted
  within ``heartbeat_misses × heartbeat_interval_s`` (+ one interval), and a
  claimed-but-unpublished batch returns via the ack timeout.
* **Execution is at-least-once**: a re-dispatched task may run twice if the
  first worker did run it (see :mod:`ax_kombu.worker`).

Signals (installed by the CLI): the first TERM/INT is a warm stop — stop
claiming, publish what is claimed, release the rest to other nodes, exit 0.
A second one is a cold stop: exit now; claimed-but-unpublished tasks come
back through the ack timeout.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import bindparam, text
from sqlalchemy.exc import SQLAlchemyError

from . import metrics, nodes
from .broker import Publisher, RawJson, TaskMessage
from .config import Settings
from .states import Status, claim, transition
from .store import Store, scan
from .store.notify import WakeListener
from .wheel import TriggerTimer

log = logging.getLogger(__name__)

#: the wheel's levels: 256 × 32 one-millisecond ticks ≈ 8.2 s; later tasks wait in the delay queue
WHEEL_LEVELS = (256, 32)
#: how often a store without wake-ups (SQLite) is polled for new tasks
POLL_WITHOUT_WAKEUPS_MS = 50


def to_message(row: Any, node: str, now_ms: int) -> TaskMessage:
    """The message for one claimed row (columns in TaskMessage order, see states.claim)."""
    return TaskMessage(row[0], row[1], row[2], RawJson(row[3]), row[4], row[5], row[6], row[7],
                       row[8], row[9], row[10], row[11], now_ms, node)


class Dispatcher(threading.Thread):
    """Publishes claimed batches in order; puts unpublished tasks back to READY.

    ``on_returned(ids)`` is called with the ids that went back to READY (still
    held by this node), so the loop can fire them again later.
    """

    def __init__(self, settings: Settings, store: Store, node: str,
                 on_returned: Callable[[list[int]], None],
                 on_published: Callable[[list[TaskMessage], int], None] | None = None) -> None:
        super().__init__(name="ax-dispatcher", daemon=True)
        self._on_published = on_published
        self.store = store
        self.node = node
        self.publisher = Publisher(settings)
        self.inbox: queue.Queue[Sequence[Any] | None] = queue.Queue(maxsize=4)
        self.broker_ok = threading.Event()
        self.published = 0
        self._on_returned = on_returned

    def probe(self) -> bool:
        """Try the broker now; True if it answers."""
        try:
            self.publisher.connect()
        except Exception as exc:  # noqa: BLE001 - any failure means "not yet"
            log.warning("broker unreachable; holding due tasks", extra={"error": repr(exc)})
            return False
        self.broker_ok.set()
        return True

    def run(self) -> None:
        while (rows := self.inbox.get()) is not None:
            self._dispatch(rows)
        self.publisher.close()

    def _dispatch(self, rows: Sequence[Any]) -> None:
        started = time.monotonic()
        now = self.store.now_ms()
        messages = [to_message(r, self.node, now) for r in rows]
        failed = self.publisher.publish(messages)
        done = self.store.now_ms()
        failed_ids = {m.task_id for m in failed}
        sent = [m for m in messages if m.task_id not in failed_ids]
        for m in sent:
            metrics.schedule_delay.observe(max(0, done - m.trigger_time) / 1000.0)
        if self._on_published is not None:
            self._on_published(sent, done)
        self.published += len(messages) - len(failed)
        metrics.dispatch_total.labels("ok").inc(len(messages) - len(failed))
        metrics.dispatch_latency.observe(time.monotonic() - started)
        if failed:
            self.broker_ok.clear()
            metrics.dispatch_total.labels("failed").inc(len(failed))
            self._give_back(sorted(failed_ids))

    def _give_back(self, ids: list[int]) -> None:
        try:
            with self.store.engine.begin() as conn:
                back = transition(conn, ids, [Status.DISPATCHING], Status.READY)
        except SQLAlchemyError:
            log.exception("could not return unpublished tasks; the ack timeout will",
                          extra={"count": len(ids)})
            return
        self._on_returned(back)


class Scheduler:
    """One scheduler node. ``run()`` until :meth:`request_stop`."""

    def __init__(self, settings: Settings, node_id: str | None = None, *,
                 on_published: Callable[[list[TaskMessage], int], None] | None = None) -> None:
        """``on_published(messages, at_ms)`` is told of every batch that reached the broker."""
        self.settings = settings
        self.store = Store(settings)
        self.node_id = node_id or nodes.default_node_id("scheduler")
        now = int(time.time() * 1000)  # replaced by database time in start()
        self.timer: TriggerTimer[int] = TriggerTimer(now, level_sizes=WHEEL_LEVELS)
        self.due: deque[int] = deque()
        self._returned: deque[list[int]] = deque()
        self._wake = threading.Event()
        self._wake_pending = True
        self._stop: str | None = None
        self.heartbeat = nodes.Heartbeat(self.store, self.node_id, "scheduler")
        self.dispatcher = Dispatcher(settings, self.store, self.node_id, self._returned.append,
                                     on_published)
        self.listener: WakeListener | None = None
        self._poll_ms = settings.preload_interval_ms
        if self.store.engine.dialect.name == "postgresql":
            self.listener = WakeListener(self.store.engine, self.wake)
        else:
            self._poll_ms = min(self._poll_ms, POLL_WITHOUT_WAKEUPS_MS)
        self._next = {"preload": 0, "beat": 0, "recovery": now + self._recovery_ms(), "db": 0}
        self._skew_warned = False

    # -- control -------------------------------------------------------------------------

    def wake(self) -> None:
        """Preload now (a producer wrote a task due soon)."""
        self._wake_pending = True
        self._wake.set()

    def request_stop(self, cold: bool = False) -> None:
        """Warm stop (or cold, if ``cold`` or already stopping). Safe from a signal handler."""
        self._stop = "cold" if cold or self._stop else "warm"
        self._wake.set()

    @property
    def stopping(self) -> str | None:
        return self._stop

    def run(self) -> None:
        if not self.start():
            self.store.close()
            return
        try:
            while self._stop is None:
                self.run_once()
        finally:
            self.shutdown()

    def start(self) -> bool:
        """Wait for the database (logging, backing off), register, start the threads.

        Returns False if a stop was requested before the database answered.
        """
        delay = 0.5
        while self._stop is None:
            try:
                self.timer = TriggerTimer(self.store.now_ms(), level_sizes=WHEEL_LEVELS)
                self.heartbeat.register(self._info())
                break
            except SQLAlchemyError as exc:
                log.warning("database unreachable; retrying",
                            extra={"error": str(getattr(exc, "orig", exc)), "retry_in_s": delay})
                self._wake.wait(delay)
                delay = min(delay * 2, 10.0)
        if self._stop is not None:
            return False
        self.dispatcher.probe()
        self.dispatcher.start()
        if self.listener is not None:
            self.listener.start()
        log.info("scheduler started", extra={"node": self.node_id})
        return True

    # -- the loop ------------------------------------------------------------------------

    def run_once(self) -> None:
        """One pass: preload, fire, claim and hand to the dispatcher, housekeeping, sleep."""
        now = self.store.now_ms()
        self._absorb_returned(now)
        if self._wake_pending or now >= self._next["preload"]:
            self._preload(now)
        self.due.extend(self.timer.advance(now))
        self._claim_due(now)
        self._housekeeping(now)
        self._sleep(now)

    def _db_ready(self, now: int) -> bool:
        return now >= self._next["db"]

    def _db_failed(self, now: int, what: str) -> None:
        log.warning("database unavailable; backing off", extra={"during": what}, exc_info=True)
        self._next["db"] = now + 1000

    def _preload(self, now: int) -> None:
        self._wake_pending = False
        if not self._db_ready(now):
            return
        room = min(self.settings.preload_batch, self.settings.max_held - len(self.timer))
        if room <= 0:
            self._next["preload"] = now + self._poll_ms
            return
        try:
            with self.store.engine.begin() as conn:
                rows = scan.preload(conn, self.node_id, now,
                                    now + self.settings.preload_window_ms, room)
        except SQLAlchemyError:
            self._db_failed(now, "preload")
            return
        for task_id, trigger in rows:
            self.timer.add(task_id, trigger)
        metrics.preload_total.inc(len(rows))
        self._next["preload"] = now if len(rows) == room else now + self._poll_ms

    def _absorb_returned(self, now: int) -> None:
        while self._returned:
            for task_id in self._returned.popleft():
                self.timer.add(task_id, now + self.settings.republish_delay_ms)

    def _claim_due(self, now: int) -> None:
        while self.due and self._stop != "cold" and self._db_ready(now):
            if not self.dispatcher.broker_ok.is_set() and not self.dispatcher.probe():
                self._hold_due(now)
                return
            batch = [self.due.popleft() for _ in range(min(len(self.due),
                                                           self.settings.claim_batch))]
            try:
                with self.store.engine.begin() as conn:
                    # a fresh reading: the loop may have waited on the dispatcher since `now`
                    rows = claim(conn, batch, self.node_id, self.store.now_ms())
                    if len(rows) < len(batch):
                        self._keep_unclaimed(conn, batch, rows, now)
            except SQLAlchemyError:
                self.due.extendleft(reversed(batch))
                self._db_failed(now, "claim")
                return
            metrics.schedule_batch_size.observe(len(rows))
            rows.sort(key=lambda r: r.trigger_time)  # RETURNING has no order
            if rows:
                self.dispatcher.inbox.put(rows)

    def _hold_due(self, now: int) -> None:
        """Broker down: put due tasks back in the timer to try again shortly."""
        while self.due:
            self.timer.add(self.due.popleft(), now + self.settings.republish_delay_ms)

    def _keep_unclaimed(self, conn: Any, batch: list[int], rows: Sequence[Any], now: int) -> None:
        """Ids the claim skipped (row locked by someone else) that are still ours: retry soon."""
        claimed = {r.task_id for r in rows}
        missing = [t for t in batch if t not in claimed]
        stmt = text("SELECT task_id FROM ax_task WHERE task_id IN :ids AND status IN "
                    "('DELAYED', 'READY') AND last_run_node = :node"
                    ).bindparams(bindparam("ids", expanding=True))
        for (task_id,) in conn.execute(stmt, {"ids": missing, "node": self.node_id}):
            self.timer.add(task_id, now + 10)

    # -- housekeeping --------------------------------------------------------------------

    def _recovery_ms(self) -> int:
        return int(self.settings.recovery_interval_s * 1000)

    def _silence_ms(self) -> int:
        return int(self.settings.heartbeat_interval_s * 1000 * self.settings.heartbeat_misses)

    def _housekeeping(self, now: int) -> None:
        metrics.wheel_queue_depth.labels("wheel").set(self.timer.wheel_depth)
        metrics.wheel_queue_depth.labels("delay").set(self.timer.delayed_depth)
        if not self._db_ready(now):
            return
        try:
            if now >= self._next["beat"]:
                self._beat(now)
            if now >= self._next["recovery"]:
                self._recover(now)
        except SQLAlchemyError:
            self._db_failed(now, "housekeeping")

    def _beat(self, now: int) -> None:
        self._next["beat"] = now + int(self.settings.heartbeat_interval_s * 1000)
        self.heartbeat.beat(self._info())
        self._check_skew()
        with self.store.engine.begin() as conn:
            dead = nodes.claim_dead(conn, self._silence_ms())
            released = scan.release_held(conn, dead)
            recovered = scan.recover_running(conn, dead, now)
        if dead:
            log.warning("nodes stopped heartbeating; recovering their tasks",
                        extra={"nodes": dead, "released": released, "running": len(recovered)})
            metrics.recovered_total.labels("held").inc(released)
            metrics.recovered_total.labels("running").inc(len(recovered))
            self.wake()

    def _recover(self, now: int) -> None:
        self._next["recovery"] = now + self._recovery_ms()
        with self.store.engine.begin() as conn:
            unacked = scan.requeue_unacked(conn, now - self.settings.ack_timeout_ms)
            orphans = scan.release_orphans(conn, now - self._silence_ms(),
                                           now - self._silence_ms())
            running = scan.recover_orphan_running(conn, now, now - self._silence_ms())
        if unacked or orphans or running:
            log.warning("recovery found tasks to dispatch again",
                        extra={"ack_timeouts": len(unacked), "orphans": orphans,
                               "running": len(running)})
            metrics.ack_timeout_total.inc(len(unacked))
            metrics.recovered_total.labels("orphan").inc(orphans)
            metrics.recovered_total.labels("running").inc(len(running))
            self.wake()

    def _check_skew(self) -> None:
        offset = self.store.clock.offset_ms
        metrics.clock_skew.set(offset / 1000.0)
        too_far = abs(offset) > self.settings.clock_skew_warn_ms
        if too_far and not self._skew_warned:
            log.warning("clock differs from the database clock; running on database time",
                        extra={"offset_ms": round(offset, 1)})
        self._skew_warned = too_far

    def _info(self) -> dict[str, Any]:
        return {"held": len(self.timer), "due": len(self.due), "wheel": self.timer.wheel_depth,
                "delay_queue": self.timer.delayed_depth,
                "clock_offset_ms": round(self.store.clock.offset_ms, 1),
                "published": self.dispatcher.published}

    def _sleep(self, now: int) -> None:
        if self.due and self.dispatcher.broker_ok.is_set() and self._db_ready(now):
            return
        if self._returned or self._wake_pending:
            return
        wake_at = min(self._next["preload"], self._next["beat"], self._next["recovery"])
        next_due = self.timer.next_due_ms()
        if next_due is not None:
            wake_at = min(wake_at, next_due)
        timeout = max(0.0, min((wake_at - now) / 1000.0, 0.25))
        if timeout > 0 and self._wake.wait(timeout):
            self._wake.clear()

    # -- stopping ------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Finish: publish what is claimed (unless cold), release held tasks, say goodbye."""
        if self.listener is not None:
            self.listener.stop()
        if self._stop != "cold":
            self.dispatcher.inbox.put(None)
            while self.dispatcher.is_alive() and self._stop != "cold":
                self.dispatcher.join(timeout=0.2)
        try:
            with self.store.engine.begin() as conn:
                released = scan.release_held(conn, [self.node_id])
            self.heartbeat.stop()
            log.info("scheduler stopped", extra={"node": self.node_id, "released": released})
        except SQLAlchemyError:
            log.warning("could not release held tasks; other nodes will recover them",
                        exc_info=True)
        self.store.close()
