"""The scheduler's dispatcher: publishes claimed batches, staged up to ``claim_lead_ms`` ahead.

Claimed rows arrive in claim order (sorted by trigger time within a batch)
and are published at once. A task may have been claimed up to
``claim_lead_ms`` before it is due (see :mod:`ax_kombu.scheduler.timing`): it is
*staged*, published ahead with its trigger time, and the worker that receives
it fences it (RUNNING) at once and starts it at that time, never before (see
:mod:`ax_kombu.worker.intake`). The round trips between due and start are then
behind it by its due time. A batch that does not certainly reach the broker
goes back to READY (compare-and-set from DISPATCHING), and the ids are handed
back to the timing loop to be fired again.

**Fenced by the live incarnation.** Each batch carries the incarnation that claimed it
(:class:`Claimed`), and it is published only while the node's
:class:`~ax_kombu.core.lease.Lease` covers that incarnation (a heartbeat sent within
the silence window, less a margin, succeeded for it). A node paused past its silence
window (SIGSTOP, a long GC, a frozen VM) finds its lease run out when it resumes: its
dispatcher waits for the next beat, and if that beat finds the node declared dead — its
claims given to another node meanwhile — the batches claimed under the old incarnation
are dropped, never published (the new registration puts what is still DISPATCHING back
to READY; anything else is the ack timeout's). A lease still undecided after the silence
window (the database unreachable) drops the batch the same way. A message that cannot be built (a
Celery-bound task's payload: :mod:`ax_kombu.broker.celery_wire`) fails its own task,
FAILED with the reason (fenced by its attempt), and nothing else: the rest of its
batch is published. Each batch is published in an ``ax.publish`` span when an
OpenTelemetry SDK is configured (:func:`ax_kombu.observability.tracing.batch_span`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from sqlalchemy.exc import SQLAlchemyError

from ax_kombu.broker.celery_wire import CELERY_MESSAGES
from ax_kombu.broker.messages import ClaimedTask, RawJson, Sendable
from ax_kombu.broker.publisher import Publisher
from ax_kombu.config import Settings, worker_queue
from ax_kombu.core.lease import Lease
from ax_kombu.core.states import Status
from ax_kombu.observability import metrics, tracing
from ax_kombu.store import Store
from ax_kombu.store.gates import Unbuildable, fail_unbuildable
from ax_kombu.store.transitions import transition

log = logging.getLogger(__name__)

#: ``on_published(messages, at_ms)``: told of every batch that reached the broker (on the
#: dispatcher's thread), e.g. :class:`ax_kombu.celery.handoff.CeleryHandOff`
OnPublished = Callable[[list[ClaimedTask], int], None]

#: how long the dispatcher waits for the lease at a time before looking again
LEASE_WAIT_S = 0.1


class Claimed(NamedTuple):
    """A claimed batch for the dispatcher: the incarnation it was claimed under, its rows."""

    incarnation: int
    rows: Sequence[Any]


def to_message(row: Any, node: str, now_ms: int) -> ClaimedTask:
    """What is published for one claimed row (read by column name: see claims.claim), built
    by keywords. Its class is the one its stored runner's table gives
    (:data:`~ax_kombu.broker.celery_wire.CELERY_MESSAGES`; ax's own otherwise)."""
    kind = CELERY_MESSAGES.get(row.runner, ClaimedTask)
    return kind(task_id=row.task_id, attempt=row.attempt, task_type=row.task_type,
                payload=RawJson(row.payload), trace_id=row.trace_id,
                trigger_time=row.trigger_time, timeout_ms=row.timeout_ms,
                priority=row.priority, retry_count=row.retry_count, max_retry=row.max_retry,
                processor=row.processor_name, callback_url=row.callback_url,
                dispatched_at=now_ms, node=node, traceparent=row.traceparent,
                tracestate=row.tracestate,
                # a shard for one worker: to that worker's own queue
                route=None if row.target_node is None else worker_queue(row.target_node))


class Dispatcher(threading.Thread):
    """Publishes claimed batches in order; puts unpublished tasks back to READY.

    ``on_returned(ids)`` is called with the ids that went back to READY (still
    this node's), so the loop can fire them again later.
    """

    def __init__(self, settings: Settings, store: Store, node: str,
                 on_returned: Callable[[list[int]], None],
                 on_published: Sequence[OnPublished] = (),
                 lease: Lease | None = None) -> None:
        super().__init__(name="ax-dispatcher", daemon=True)
        self._on_published = tuple(on_published)
        self.store = store
        self.node = node
        self.publisher = Publisher(settings)
        self.inbox: queue.Queue[Claimed | None] = queue.Queue(maxsize=4)
        #: publishing needs the lease to cover a batch's incarnation (None: not fenced)
        self._lease = lease
        self._lease_wait_s = settings.silence_ms / 1000.0
        #: claims dropped because their incarnation was declared dead (or stayed in doubt)
        self.dropped = 0
        self.broker_ok = threading.Event()
        self.published = 0
        self._on_returned = on_returned
        self._publisher_lock = threading.Lock()
        #: why the broker was last found unreachable (None: not down, or not known to be)
        self._down_cause: str | None = None

    def probe(self) -> bool:
        """Try the broker now; True if it answers.

        Called again and again while the broker is down, it logs a warning only
        when the cause changes (the first failure, then a different error), and
        an info line once the broker answers again.
        """
        try:
            with self._publisher_lock:
                self.publisher.connect()
        except Exception as exc:  # noqa: BLE001 - any failure means "not yet"
            self._report_down(repr(exc))
            return False
        self._report_up()
        self.broker_ok.set()
        return True

    def _report_down(self, cause: str) -> None:
        if cause != self._down_cause:
            log.warning("broker unreachable; due tasks wait for it", extra={"error": cause})
            self._down_cause = cause

    def _report_up(self) -> None:
        if self._down_cause is not None:
            log.info("broker reachable again; dispatching", extra={"was": self._down_cause})
            self._down_cause = None

    def run(self) -> None:
        while (batch := self.inbox.get()) is not None:
            if self._live(batch.incarnation):
                self._publish(batch.rows)  # now: each carries its trigger time and starts then
            else:
                self.dropped += len(batch.rows)
                log.warning("claims of an incarnation declared dead (or in doubt) not "
                            "published", extra={"node": self.node, "count": len(batch.rows),
                                                "incarnation": batch.incarnation})
        with self._publisher_lock:
            self.publisher.close()

    def _live(self, incarnation: int) -> bool:
        """Whether the lease covers ``incarnation`` now, waiting while it is undecided (a
        beat is due), at most the silence window."""
        if self._lease is None:
            return True
        deadline = time.monotonic() + self._lease_wait_s
        while (covered := self._lease.covers(incarnation)) is None:
            if time.monotonic() >= deadline:
                return False
            self._lease.wait(incarnation, LEASE_WAIT_S)
        return covered

    def _now(self) -> int:
        return int(self.store.clock.local_ms())  # never waits on the database

    def _publish(self, rows: Sequence[Any]) -> None:
        started = time.monotonic()
        now = self._now()
        messages = [to_message(r, self.node, now) for r in rows]
        with self._publisher_lock, tracing.batch_span("ax.publish", len(messages)):
            failed, refused = self.publisher.send(messages)
        done = self._now()
        if refused:
            self._fail_refused(refused, done)
        unsent = {m.task_id for m in failed} | {m.task_id for m, _ in refused}
        sent = [m for m in messages if m.task_id not in unsent]
        delays: dict[str, list[float]] = {}
        for m in sent:  # staged ahead: 0
            delays.setdefault(m.priority, []).append(max(0, done - m.trigger_time) / 1000.0)
        for priority, values in delays.items():
            metrics.observe_many(metrics.schedule_delay.labels(queue=priority), values)
        for hook in self._on_published:
            hook(sent, done)
        self.published += len(sent)
        metrics.dispatch_total.labels("ok").inc(len(sent))
        metrics.dispatch_latency.observe(time.monotonic() - started)
        if failed:
            self.broker_ok.clear()
            metrics.dispatch_total.labels("failed").inc(len(failed))
            self._give_back(failed)

    def _fail_refused(self, refused: Sequence[tuple[Sendable, str]], now_ms: int) -> None:
        """Messages that cannot be built: their tasks end FAILED with the reason. A database
        error leaves them DISPATCHING: the ack timeout sends them again (and they fail then)."""
        metrics.dispatch_total.labels("refused").inc(len(refused))
        failures = [Unbuildable(m.task_id, m.attempt, reason) for m, reason in refused]
        try:
            with self.store.engine.begin() as conn:
                fail_unbuildable(conn, failures, self.node, now_ms)
        except SQLAlchemyError:
            log.exception("could not fail tasks whose message cannot be built; the ack "
                          "timeout will", extra={"count": len(failures)})

    def _give_back(self, failed: Sequence[Sendable]) -> None:
        """Unpublished tasks DISPATCHING → READY, each only at the attempt its message
        carried: a publish that fails after a pause (a confirm timed out while the node
        was stopped) must not move a row another node has claimed again meanwhile."""
        by_attempt: dict[int, list[int]] = {}
        for m in sorted(failed, key=lambda m: m.task_id):
            by_attempt.setdefault(m.attempt, []).append(m.task_id)
        try:
            with self.store.engine.begin() as conn:
                back = [task_id for attempt, ids in by_attempt.items()
                        for task_id in transition(conn, ids, [Status.DISPATCHING],
                                                  Status.READY, attempt=attempt)]
        except SQLAlchemyError:
            log.exception("could not return unpublished tasks; the ack timeout will",
                          extra={"count": len(failed)})
            return
        self._on_returned(back)
