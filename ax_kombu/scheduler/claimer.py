"""The claimer: fired ids → one conditional claim per batch → the dispatcher.

Contracts:

* **One claim statement per batch** (:func:`ax_kombu.store.claims.claim`:
  ``UPDATE … WHERE status IN (DELAYED, READY) … RETURNING``): the ids fired
  while the previous claim ran form the next batch, up to ``claim_batch``. A
  row moves to DISPATCHING for exactly one node, with a new attempt number, and
  only the claimed rows are handed to the dispatcher (sorted by trigger time).
  Why claim even though the schedulers split the ids between them (each preloads
  its share, :mod:`ax_kombu.store.recovery`): while they see different sets of live
  schedulers two may have the same task in memory, and the database stays the one
  arbiter.
* **Durable before it is handed on**: on PostgreSQL the statement runs in
  autocommit on the claimer's own connection (one round trip; the claim is
  committed when it returns). That connection is never returned to the pool,
  and is replaced after any error. On SQLite it runs in a ``BEGIN IMMEDIATE``
  transaction (see :mod:`ax_kombu.store.engine`).
* **Skipped ids are not lost**: ids the claim did not move that are still
  claimable (a Celery-bound task not due yet) fire again shortly; those no
  longer claimable (cancelled, claimed elsewhere, parked) are dropped: if one
  becomes claimable again, the preload reads it again.
* **A lost reply is resumed, not dropped**: a claim that fails may have committed
  (the connection dropped after the commit, before the answer). Its batch is tried
  again, before anything else, as a *resume* with the same ``now``
  (:func:`ax_kombu.store.claims.claim`): rows still claimable are claimed, and
  rows the lost statement moved — DISPATCHING, ``owner_node`` this node, ``dispatched_at`` =
  that ``now`` — come back at the attempt it gave them and are published, not left
  DISPATCHING until the ack timeout. Every claim of this claimer writes a
  ``dispatched_at`` later than the one before (:meth:`Claimer._claim_now`), so that
  pair names one claim statement of one process: no other claim's rows match.
* **A runner's own lead** (:data:`ax_kombu.core.runners.FIXED_LEADS`): the claim statement
  takes such a task only once it is that lead from due on the claimer's database clock
  (:mod:`ax_kombu.store.claims`; 0 for stock Celery workers, which are not staged); it
  reaches the wheel ``claim_lead_ms`` minus that lead late, so it fires then.
* **Gated tasks** (an order key, a job strategy, a type with a limit) are left
  by the claim statement; the due ones among the skipped go through the gated
  claim at once (:mod:`ax_kombu.store.gates`: what may start is claimed, what
  must wait is parked in the store until a run of its key or type ends).
* **Broker down → no claims**: while the dispatcher reports the broker
  unreachable, fired ids go back to the wheel for ``republish_delay_ms`` and
  nothing is claimed, so no task is moved to DISPATCHING that cannot be sent.
* **Paused types and queues** (:mod:`ax_kombu.store.pauses`): while something is paused,
  the claim statement and the check of skipped ids leave its tasks (the pauses the
  housekeeper's last preload round read: no query of its own); a paused task loaded
  before its pause landed is refused and dropped from memory. A resume (a lost reply)
  repeats its claim as it was.
* Each claim statement runs in an ``ax.claim`` span when an OpenTelemetry SDK is configured
  (:func:`ax_kombu.observability.tracing.batch_span`; nothing otherwise).
* On :meth:`~ax_kombu.scheduler.loop.Loop.stop` the claimer ends after the
  batch in hand; what is fired but unclaimed stays claimable in the store, for
  the other schedulers' preload.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, NamedTuple

from sqlalchemy import Connection
from sqlalchemy.exc import SQLAlchemyError

from ax_kombu.config import Settings
from ax_kombu.core.ids import ReservedIds
from ax_kombu.core.lease import Lease
from ax_kombu.observability import metrics, tracing
from ax_kombu.scheduler.dispatcher import Claimed, Dispatcher
from ax_kombu.scheduler.loop import MAX_SLEEP_S, Loop, Mailbox
from ax_kombu.scheduler.timing import TimingLoop
from ax_kombu.store import Store, nodes
from ax_kombu.store.claims import claim, still_claimable
from ax_kombu.store.gates import Broadcast, claim_gated
from ax_kombu.store.pauses import NONE, PauseWatch

log = logging.getLogger(__name__)


#: after a claim fails the first time, the pause before it is resumed (then DB_BACKOFF_S)
_RESUME_PAUSE_S = 0.05


class _Claim(NamedTuple):
    """One claim: its ids, its ``now`` and ``due_before``, and whether it repeats one whose
    outcome is unknown (:func:`ax_kombu.store.claims.claim`'s ``resume``)."""

    ids: list[int]
    now: int
    due_before: int
    resume: bool


class Claimer(Loop):
    """Claims fired ids batch after batch and puts the claimed rows in the dispatcher's inbox.

    Args:
        settings: ``claim_batch``, ``claim_lead_ms``, ``claim_window_ms`` and
            ``republish_delay_ms`` are read.
        store: the task store.
        node_id: the node the claims are made for.
        fired: the mailbox the timing loop fires ids into; read by this stage alone.
        timing: where ids that must fire again are handed back.
        dispatcher: where claimed rows go; also says whether the broker answers.
        lease: each batch goes to the dispatcher with the incarnation its lease had
            confirmed before the claim: the dispatcher publishes it only while the lease
            covers that incarnation (see :mod:`ax_kombu.scheduler.dispatcher`).
        paused: the pauses the housekeeper last read (its own, empty, if None).
    """

    def __init__(self, settings: Settings, store: Store, node_id: str, fired: Mailbox[int],
                 timing: TimingLoop, dispatcher: Dispatcher, ids: ReservedIds,
                 lease: Lease | None = None, paused: PauseWatch | None = None) -> None:
        super().__init__("ax-claimer", fired.ready)
        self._batch = settings.claim_batch
        self._lead_ms = settings.claim_lead_ms
        #: how far ahead of its ``now`` a claim takes tasks (the timing loop fires that far
        #: ahead when the next id reaches its lead)
        self._reach_ms = settings.claim_reach_ms
        self._hold_s = settings.republish_delay_ms / 1000.0
        self._hold_ms = settings.republish_delay_ms
        self._store = store
        self._node_id = node_id
        self._fired = fired
        self._timing = timing
        self._dispatcher = dispatcher
        self._pg = store.engine.dialect.name == "postgresql"
        self._conn: Connection | None = None  # PostgreSQL: this stage's own, in autocommit
        self._ids = ids
        self._lease = lease
        self._paused = paused or PauseWatch()
        #: the claim time of this claimer's last claim (each is later: see _claim_now)
        self._last_now = 0
        #: a claim whose outcome is unknown, to be resumed before anything else
        self._unsure: _Claim | None = None
        self._broadcast = Broadcast(
            lambda conn, priority: nodes.workers_consuming(
                conn, settings.queue_for(priority), settings.silence_ms),
            ids.next_ids)

    @property
    def due(self) -> int:
        """How many fired ids wait to be claimed."""
        return len(self._fired)

    def run(self) -> None:
        try:
            while not self.stopping:
                self._step()
        finally:
            self._drop_connection()

    def _step(self) -> None:
        """Resume a claim whose reply was lost, or claim the next batch; or keep the fired
        ids while the broker is down; or sleep."""
        fired = self._fired.items
        if not fired and self._unsure is None:
            self._fired.wait(MAX_SLEEP_S)
            return
        broker = self._dispatcher
        if not broker.broker_ok.is_set() and not broker.probe():
            self._hold_fired()
            return
        if self._unsure is not None and self._timing.dropping:
            self._unsure = None  # declared dead: what the lost claim moved is recovery's
        if self._unsure is not None:
            self._claim(self._unsure)
            return
        now = self._claim_now()
        self._claim(_Claim([fired.popleft() for _ in range(min(len(fired), self._batch))],
                           now, now + self._reach_ms, resume=False))

    def _claim(self, batch: _Claim) -> None:
        """Claim ``batch`` (ids due up to ``claim_reach_ms`` from its ``now``: the lead and
        the claim window, as far ahead as they fire, see :mod:`ax_kombu.scheduler.timing`)
        and hand what was claimed to the dispatcher. On a database error the claim may have
        committed: it is kept, to be resumed (see the module docstring)."""
        incarnation = self._incarnation()
        try:
            with tracing.batch_span("ax.claim", len(batch.ids)):
                rows = self._claim_rows(batch)
        except SQLAlchemyError as exc:
            first = self._unsure is None
            self._unsure = batch._replace(resume=True)
            if first:  # most often one dropped connection: try again at once, on a new one
                log.warning("claim failed, its outcome unknown; resuming it",
                            extra={"count": len(batch.ids), "error": repr(exc)})
                self.pause(_RESUME_PAUSE_S)
            else:
                self.db_failed("claim", exc)
            return
        self._unsure = None
        metrics.schedule_batch_size.observe(len(rows))
        if rows:
            rows.sort(key=lambda r: r.trigger_time)  # RETURNING has no order
            self._dispatcher.inbox.put(Claimed(incarnation, rows))
        if len(rows) < len(batch.ids):
            self._keep_unclaimed(batch.ids, rows)

    def _claim_rows(self, batch: _Claim) -> list[Any]:
        """One claim statement: autocommit on the claimer's own connection (PostgreSQL)."""
        args = (batch.ids, self._node_id, batch.now, batch.due_before)
        paused = NONE if batch.resume else self._paused.current
        if not self._pg:
            with self._store.engine.begin() as conn:
                return claim(conn, *args, resume=batch.resume, paused=paused)
        if self._conn is None:
            conn = self._store.engine.connect()
            self._conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        try:
            return claim(self._conn, *args, resume=batch.resume, paused=paused)
        except SQLAlchemyError:
            self._drop_connection()  # a new one next time
            raise

    def _claim_now(self) -> int:
        """The time a claim is made at (its ``dispatched_at``): the local reading of the
        database clock, but always later than this claimer's previous claim, so that
        ``(node, dispatched_at)`` names one claim statement (a resume looks for it)."""
        self._last_now = max(self._local_ms(), self._last_now + 1)
        return self._last_now

    def _drop_connection(self) -> None:
        """Discard (never pool) the claimer's connection: it may be broken, and it is in
        autocommit, which the pool's other users do not expect."""
        if self._conn is not None:
            self._conn.invalidate()
            self._conn.close()
            self._conn = None

    def _hold_fired(self) -> None:
        """Broker down: fired ids go back to the wheel to be tried again shortly."""
        fired = self._fired.items
        self._timing.retry_later([fired.popleft() for _ in range(len(fired))])
        self.pause(self._hold_s)

    def _keep_unclaimed(self, batch: list[int], rows: Sequence[Any]) -> None:
        """Ids the claim skipped that are still claimable: gated and due → the gated claim;
        others fire again soon, a Celery-bound one not due yet at its trigger time (its
        time here is ``claim_lead_ms`` late, see :func:`ax_kombu.store.claims.fire_time`),
        each at its own time, never early with a claim window (``hand_solo``);
        the rest (claimed elsewhere, cancelled, parked, paused) are dropped."""
        claimed = {r.task_id for r in rows}
        missing = [t for t in batch if t not in claimed]
        try:
            with self._store.engine.connect() as conn:
                ours = still_claimable(conn, missing, claim_lead_ms=self._lead_ms,
                                       paused=self._paused.current)
        except SQLAlchemyError as exc:
            self._timing.retry_later(missing)  # the next claim sorts out which are still ours
            self.db_failed("claim", exc)
            return
        due_before = self._local_ms() + self._reach_ms
        gated = [task_id for task_id, trigger, is_gated in ours
                 if is_gated and trigger <= due_before]
        if gated:
            self._claim_gated(gated)
        soon = self._local_ms() + 10
        self._timing.hand_solo([(task_id, max(trigger, soon))
                                for task_id, trigger, is_gated in ours
                                if not (is_gated and trigger <= due_before)])

    def _claim_gated(self, task_ids: list[int]) -> None:
        """One gated claim: claim what may start, park what must wait (one transaction).
        What it leaves (a broadcast with no live worker yet) is tried again later."""
        now = self._claim_now()
        incarnation = self._incarnation()
        try:
            self._ids.next_ids(0)  # renew the id lease now, not inside the transaction
            with self._store.engine.begin() as conn:
                rows, decision = claim_gated(conn, task_ids, self._node_id, now,
                                             now + self._reach_ms, self._broadcast)
        except SQLAlchemyError as exc:
            self._timing.retry_later(task_ids)
            self.db_failed("gated claim", exc)
            return
        for action in ("start", "wait", "cancel", "supersede"):
            metrics.gate_total.labels(action).inc(len(getattr(decision, action)))
        settled = {r.task_id for r in rows} | set(decision.wait) | {
            task_id for task_id, _ in decision.cancel + decision.supersede}
        left = [task_id for task_id in task_ids if task_id not in settled]
        if left:
            self._timing.hand([(task_id, now + self._hold_ms) for task_id in left])
        if rows:
            rows.sort(key=lambda r: r.trigger_time)
            self._dispatcher.inbox.put(Claimed(incarnation, rows))

    def _incarnation(self) -> int:
        """The incarnation a claim made now is made under (the lease's last confirmed)."""
        return self._lease.incarnation if self._lease is not None else 0

    def _local_ms(self) -> int:
        return int(self._store.clock.local_ms())
