"""ax-scheduler: preload → timing wheel → batched claim → Kombu publish, plus recovery.

One node runs four threads, one per stage, so that no stage waits on another's I/O:

* the **timing loop** (the thread that calls :meth:`Scheduler.run`) owns the
  wheel and never touches the database or the broker: it adds the ids it is
  handed, fires what is due and sleeps until the next id is due;
* the **claimer** claims fired ids in the database;
* the **dispatcher** (:class:`ax_kombu.scheduler.dispatcher.Dispatcher`) publishes claimed batches;
* the **housekeeper** preloads, heartbeats, recovers and re-measures the
  database clock.

The stages, on the database clock:

1. **Preload** (housekeeper; every ``preload_interval_ms``, at once on a
   producer's wake-up, and again straight away while it keeps finding full
   batches): takes tasks due within ``preload_window_ms`` into memory —
   CREATED rows and rows nobody holds (:mod:`ax_kombu.store.recovery`). Memory is
   bounded by the window and ``max_held``, never by how many future tasks exist.
2. **Timing wheel** (timing loop; :class:`ax_kombu.core.wheel.TriggerTimer`): an
   8 s millisecond wheel in front of a delay queue for the rest of the window.
   Due ids come out in trigger order; firing is a slot lookup. The loop reads
   the clock locally (:meth:`ax_kombu.store.clock.DbClock.local_ms`), so a
   slow preload or claim never makes it late.
3. **Claim** (claimer): ids fire ``claim_lead_ms`` (default 20) before they
   are due, so that the claim's round trip is over by then; the ids fired
   while the previous claim ran form the next batch (up to ``claim_batch``),
   claimed with one conditional statement
   (:func:`ax_kombu.store.claims.claim`: ``UPDATE … WHERE status IN (DELAYED,
   READY) … RETURNING``). On PostgreSQL the statement runs in autocommit:
   one round trip, and the claim is durable when it returns — before any row
   is handed on. Why claim rather than partition: any node may end up
   holding any task (adoption after a node dies), and the database stays the
   one arbiter — a row moves to DISPATCHING for exactly one node, with a new
   attempt number.
4. **Publish** (dispatcher; overlaps the next claim): each claimed task at
   its due time, never before (``dispatched_at`` records the claim, so it may
   precede ``trigger_time`` by up to the lead); Kombu, to the queue of the
   task's priority, with publisher confirms on RabbitMQ. A batch that
   does not certainly reach the broker goes back to READY (compare-and-set
   from DISPATCHING); the claimer stops claiming until the broker answers
   again, then they go out with a new attempt.
5. **Recovery** (housekeeper): every heartbeat the node looks for dead nodes
   (no heartbeat for ``heartbeat_misses`` intervals): their held tasks are
   released (and adopted by the next preload anywhere) and a dead worker's
   RUNNING tasks are retried or failed. Every ``recovery_interval_s``:
   DISPATCHING tasks older than ``ack_timeout_ms`` go back to READY, and due
   tasks held by nobody alive are released.

Guarantees:

* **Exactly-once dispatch per attempt**: only the node whose claim moved the
  row publishes it, and a worker runs a message only if its attempt is the
  row's current one.
* **Nothing lost**: a task is always in the database in a state some node
  acts on. If a node is killed (even ``kill -9``), its held tasks are adopted
  within ``heartbeat_misses × heartbeat_interval_s`` (+ one interval), and a
  claimed-but-unpublished batch returns via the ack timeout.
* **Execution is at-least-once**: a re-dispatched task may run twice if the
  first worker did run it (see :mod:`ax_kombu.worker.node`).

Signals (installed by the CLI): the first TERM/INT is a warm stop — stop
claiming, publish what is claimed, release the rest to other nodes, exit 0.
A second one is a cold stop: exit now; claimed-but-unpublished tasks come
back through the ack timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import Connection, bindparam, text
from sqlalchemy.exc import SQLAlchemyError

from ax_kombu.broker.messages import TaskMessage
from ax_kombu.config import Settings
from ax_kombu.core.wheel import TriggerTimer
from ax_kombu.observability import metrics
from ax_kombu.scheduler.dispatcher import Dispatcher
from ax_kombu.store import Store, nodes, recovery
from ax_kombu.store.claims import claim
from ax_kombu.store.notify import WakeListener

log = logging.getLogger(__name__)

#: the wheel's levels: 256 × 32 one-millisecond ticks ≈ 8.2 s; later tasks wait in the delay queue
WHEEL_LEVELS = (256, 32)
#: how often a store without wake-ups (SQLite) is polled for new tasks
POLL_WITHOUT_WAKEUPS_MS = 50
#: most ids the timing loop adds to the wheel between two firings (bounds its pause)
ABSORB_CHUNK = 2000
#: longest any of the node's threads sleeps before looking at the stop flag again
MAX_SLEEP_S = 0.25
#: how long a thread waits after a database error before trying again
DB_BACKOFF_S = 1.0

#: (task_id, due_ms) pairs handed to the timing loop
Pairs = Sequence[tuple[int, int]]


class Scheduler:
    """One scheduler node. ``run()`` until :meth:`request_stop`.

    ``run()`` is the timing loop; it starts the claimer, the dispatcher and the
    housekeeper beside it and stops them on the way out. The threads meet only
    at two hand-offs, each a deque plus an event: ids for the wheel
    (``_incoming``, read by the timing loop alone, which alone touches the
    wheel) and fired ids (``_fired``, read by the claimer alone).
    """

    def __init__(self, settings: Settings, node_id: str | None = None, *,
                 on_published: Callable[[list[TaskMessage], int], None] | None = None) -> None:
        """``on_published(messages, at_ms)`` is told of every batch that reached the broker."""
        self.settings = settings
        self.store = Store(settings)
        self.node_id = node_id or nodes.default_node_id("scheduler")
        now = int(time.time() * 1000)  # replaced by database time in start()
        self.timer: TriggerTimer[int] = TriggerTimer(now, level_sizes=WHEEL_LEVELS)
        self._incoming: deque[Pairs] = deque()
        self._wake = threading.Event()  # the timing loop: ids came in, or stop
        self._fired: deque[int] = deque()
        self._claim_wake = threading.Event()  # the claimer: ids fired, or stop
        self._house_wake = threading.Event()  # the housekeeper: preload now, or stop
        self._stopped = threading.Event()  # set once the node stops: ends every back-off
        self._wake_pending = True
        self._stop: str | None = None
        self.heartbeat = nodes.Heartbeat(self.store, self.node_id, "scheduler")
        self.dispatcher = Dispatcher(settings, self.store, self.node_id, self._retry_later,
                                     on_published)
        self._claim_conn: Connection | None = None  # the claimer's own (PostgreSQL)
        self._claimer = threading.Thread(target=self._claim_loop, name="ax-claimer",
                                         daemon=True)
        self._housekeeper = threading.Thread(target=self._housekeeping_loop,
                                             name="ax-housekeeper", daemon=True)
        self.listener: WakeListener | None = None
        self._poll_ms = settings.preload_interval_ms
        self._pg = self.store.engine.dialect.name == "postgresql"
        if self._pg:
            self.listener = WakeListener(self.store.engine, self.wake)
        else:
            self._poll_ms = min(self._poll_ms, POLL_WITHOUT_WAKEUPS_MS)
        self._next = {"preload": 0, "beat": 0, "recovery": now + self._recovery_ms()}
        self._skew_warned = False

    # -- control -------------------------------------------------------------------------

    def wake(self) -> None:
        """Preload now (a producer wrote a task due soon)."""
        self._wake_pending = True
        self._house_wake.set()

    def request_stop(self, cold: bool = False) -> None:
        """Warm stop (or cold, if ``cold`` or already stopping). Safe from a signal handler:
        it sets a flag and wakes the timing loop, which stops the other threads."""
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
        for thread in (self.dispatcher, self._claimer, self._housekeeper):
            thread.start()
        if self.listener is not None:
            self.listener.start()
        log.info("scheduler started", extra={"node": self.node_id})
        return True

    def _db_failed(self, what: str, exc: SQLAlchemyError) -> None:
        """Log a database error and back off (on the calling thread) before the next try."""
        log.warning("database unavailable; backing off", extra={"during": what}, exc_info=exc)
        self._stopped.wait(DB_BACKOFF_S)

    def _local_ms(self) -> int:
        return int(self.store.clock.local_ms())

    # -- the timing loop: the wheel's only user; never waits on the database or the broker --

    def run_once(self) -> None:
        """One pass: take in handed-over ids, fire what is due to the claimer, sleep."""
        self._absorb()
        now = self.store.clock.local_ms()
        fired = self.timer.advance(int(now) + self.settings.claim_lead_ms)  # see _claim_rows
        if fired:
            self._fired.extend(fired)
            self._claim_wake.set()
        self._sleep(now)

    def _hand_to_wheel(self, pairs: Pairs) -> None:
        """From any thread: have the timing loop schedule ``(task_id, due_ms)`` pairs."""
        for start in range(0, len(pairs), ABSORB_CHUNK):
            self._incoming.append(pairs[start:start + ABSORB_CHUNK])
        if pairs:
            self._wake.set()

    def _retry_later(self, ids: Sequence[int]) -> None:
        """Fire ``ids`` again after ``republish_delay_ms`` (they are still held by this node)."""
        due = self._local_ms() + self.settings.republish_delay_ms
        self._hand_to_wheel([(task_id, due) for task_id in ids])

    def _absorb(self) -> None:
        """Add handed-over ids to the wheel, about ``ABSORB_CHUNK`` per pass so firing goes on."""
        taken = 0
        while self._incoming and taken < ABSORB_CHUNK:
            pairs = self._incoming.popleft()
            for task_id, due in pairs:
                self.timer.add(task_id, due)
            taken += len(pairs)

    def _sleep(self, now: float) -> None:
        """Until the next id is due, ids are handed over, or a stop (at most MAX_SLEEP_S)."""
        if self._incoming or self._stop is not None:
            return
        timeout = MAX_SLEEP_S
        next_due = self.timer.next_due_ms()
        if next_due is not None:
            timeout = min(timeout, (next_due - self.settings.claim_lead_ms - now) / 1000.0)
        if timeout > 0 and self._wake.wait(timeout):
            self._wake.clear()

    # -- the claimer ---------------------------------------------------------------------

    def _claim_loop(self) -> None:
        """Claim fired ids batch after batch until a stop (a warm one ends after this batch:
        what is fired but unclaimed stays held and is released in :meth:`shutdown`)."""
        try:
            while self._stop is None:
                if not self._fired:
                    if self._claim_wake.wait(MAX_SLEEP_S):
                        self._claim_wake.clear()
                    continue
                if not self.dispatcher.broker_ok.is_set() and not self.dispatcher.probe():
                    self._hold_fired()
                    continue
                batch = [self._fired.popleft()
                         for _ in range(min(len(self._fired), self.settings.claim_batch))]
                self._claim(batch)
        finally:
            self._drop_claim_connection()

    def _claim(self, batch: list[int]) -> None:
        """Claim ``batch`` and hand what was claimed to the dispatcher."""
        try:
            rows = self._claim_rows(batch)
        except SQLAlchemyError as exc:
            self._fired.extendleft(reversed(batch))  # nothing was claimed: try again
            self._db_failed("claim", exc)
            return
        metrics.schedule_batch_size.observe(len(rows))
        if rows:
            rows.sort(key=lambda r: r.trigger_time)  # RETURNING has no order
            self.dispatcher.inbox.put(rows)
        if len(rows) < len(batch):
            self._keep_unclaimed(batch, rows)

    def _claim_rows(self, batch: list[int]) -> list[Any]:
        """One claim statement. PostgreSQL: on the claimer's own connection, in autocommit,
        so the claim is one round trip and durable when it returns. SQLite: in a
        ``BEGIN IMMEDIATE`` transaction (see store.engine)."""
        now = self._local_ms()
        due_before = now + self.settings.claim_lead_ms  # fired that far ahead (run_once)
        if not self._pg:
            with self.store.engine.begin() as conn:
                return claim(conn, batch, self.node_id, now, due_before)
        if self._claim_conn is None:
            conn = self.store.engine.connect()
            self._claim_conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        try:
            return claim(self._claim_conn, batch, self.node_id, now, due_before)
        except SQLAlchemyError:
            self._drop_claim_connection()  # a new one next time
            raise

    def _drop_claim_connection(self) -> None:
        """Discard (never pool) the claimer's connection: it may be broken, and it is in
        autocommit, which the pool's other users do not expect."""
        if self._claim_conn is not None:
            self._claim_conn.invalidate()
            self._claim_conn.close()
            self._claim_conn = None

    def _hold_fired(self) -> None:
        """Broker down: fired ids go back to the wheel to be tried again shortly."""
        ids = [self._fired.popleft() for _ in range(len(self._fired))]
        self._retry_later(ids)
        self._stopped.wait(self.settings.republish_delay_ms / 1000.0)

    def _keep_unclaimed(self, batch: list[int], rows: Sequence[Any]) -> None:
        """Ids the claim skipped (row locked by someone else) that are still ours: retry soon.

        Those no longer ours (cancelled, claimed elsewhere, released) are dropped.
        """
        claimed = {r.task_id for r in rows}
        missing = [t for t in batch if t not in claimed]
        stmt = text("SELECT task_id, trigger_time FROM ax_task WHERE task_id IN :ids "
                    "AND status IN ('DELAYED', 'READY') AND last_run_node = :node"
                    ).bindparams(bindparam("ids", expanding=True))
        try:
            with self.store.engine.connect() as conn:
                ours = list(conn.execute(stmt, {"ids": missing, "node": self.node_id}))
        except SQLAlchemyError as exc:
            self._retry_later(missing)  # the next claim sorts out which are still ours
            self._db_failed("claim", exc)
            return
        soon = self._local_ms() + 10
        self._hand_to_wheel([(task_id, max(trigger, soon)) for task_id, trigger in ours])

    # -- the housekeeper -----------------------------------------------------------------

    def _recovery_ms(self) -> int:
        return int(self.settings.recovery_interval_s * 1000)

    def _silence_ms(self) -> int:
        return int(self.settings.heartbeat_interval_s * 1000 * self.settings.heartbeat_misses)

    def _housekeeping_loop(self) -> None:
        """Preload, heartbeat, recovery; each when due, until a stop."""
        while self._stop is None:
            try:
                timeout = self._housekeeping(self.store.now_ms())  # re-measures the clock
            except SQLAlchemyError as exc:
                self._db_failed("housekeeping", exc)
                continue
            if timeout > 0 and self._house_wake.wait(timeout):
                self._house_wake.clear()

    def _housekeeping(self, now: int) -> float:
        """Do what is due; returns how long to sleep (seconds)."""
        metrics.wheel_queue_depth.labels("wheel").set(self.timer.wheel_depth)
        metrics.wheel_queue_depth.labels("delay").set(self.timer.delayed_depth)
        preload_due = self._wake_pending or now >= self._next["preload"]
        if preload_due and not self._incoming:  # the last preload is in the wheel: max_held holds
            self._preload(now)
        if now >= self._next["beat"]:
            self._beat(now)
        if now >= self._next["recovery"]:
            self._recover(now)
        if self._wake_pending or self._next["preload"] <= now:
            return 0.001 if self._incoming else 0.0
        wake_at = min(self._next.values())
        return max(0.0, min((wake_at - now) / 1000.0, MAX_SLEEP_S))

    def _preload(self, now: int) -> None:
        self._wake_pending = False
        room = min(self.settings.preload_batch, self.settings.max_held - len(self.timer))
        if room <= 0:
            self._next["preload"] = now + self._poll_ms
            return
        try:
            with self.store.engine.begin() as conn:
                rows = recovery.preload(conn, self.node_id, now,
                                    now + self.settings.preload_window_ms, room)
        except SQLAlchemyError:
            self._wake_pending = True  # try again after the back-off
            raise
        self._hand_to_wheel(rows)
        metrics.preload_total.inc(len(rows))
        self._next["preload"] = now if len(rows) == room else now + self._poll_ms

    def _beat(self, now: int) -> None:
        self._next["beat"] = now + int(self.settings.heartbeat_interval_s * 1000)
        self.heartbeat.beat(self._info())
        self._check_skew()
        with self.store.engine.begin() as conn:
            dead = nodes.claim_dead(conn, self._silence_ms())
            released = recovery.release_held(conn, dead)
            recovered = recovery.recover_running(conn, dead, now)
        if dead:
            log.warning("nodes stopped heartbeating; recovering their tasks",
                        extra={"nodes": dead, "released": released, "running": len(recovered)})
            metrics.recovered_total.labels("held").inc(released)
            metrics.recovered_total.labels("running").inc(len(recovered))
            self.wake()

    def _recover(self, now: int) -> None:
        self._next["recovery"] = now + self._recovery_ms()
        with self.store.engine.begin() as conn:
            unacked = recovery.requeue_unacked(conn, now - self.settings.ack_timeout_ms)
            orphans = recovery.release_orphans(conn, now - self._silence_ms(),
                                           now - self._silence_ms())
            running = recovery.recover_orphan_running(conn, now, now - self._silence_ms())
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
        return {"held": len(self.timer), "due": len(self._fired),
                "wheel": self.timer.wheel_depth, "delay_queue": self.timer.delayed_depth,
                "clock_offset_ms": round(self.store.clock.offset_ms, 1),
                "published": self.dispatcher.published}

    # -- stopping ------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Finish: publish what is claimed (unless cold), release held tasks, say goodbye."""
        self._stopped.set()
        for event in (self._claim_wake, self._house_wake):
            event.set()
        if self.listener is not None:
            self.listener.stop()
        # the housekeeper first: a preload still running must land before the release below
        self._join(self._housekeeper)
        self._join(self._claimer)
        if self._stop != "cold" and self.dispatcher.is_alive():
            self.dispatcher.inbox.put(None)
            self._join(self.dispatcher)
        try:
            with self.store.engine.begin() as conn:
                released = recovery.release_held(conn, [self.node_id])
            self.heartbeat.stop()
            log.info("scheduler stopped", extra={"node": self.node_id, "released": released})
        except SQLAlchemyError:
            log.warning("could not release held tasks; other nodes will recover them",
                        exc_info=True)
        self.store.close()

    def _join(self, thread: threading.Thread) -> None:
        """Wait for ``thread`` unless (or until) the stop turns cold."""
        while thread.is_alive() and self._stop != "cold":
            thread.join(timeout=0.2)
