"""The scheduler's dispatcher: publishes claimed batches, staged up to ``claim_lead_ms`` ahead.

Claimed rows arrive in claim order (sorted by trigger time within a batch)
and are published at once. A task may have been claimed up to
``claim_lead_ms`` before it is due (see :mod:`ax_kombu.scheduler.timing`): it is
*staged*, published ahead with its trigger time, and the worker that receives
it fences it (RUNNING) at once and starts it at that time, never before (see
:mod:`ax_kombu.worker.intake`). The round trips between due and start are then
behind it by its due time. A batch that does not certainly reach the broker
goes back to READY (compare-and-set from DISPATCHING), and the ids are handed
back to the timing loop to be fired again. A message that cannot be built (a
Celery-bound task's payload: :mod:`ax_kombu.broker.celery_wire`) fails its own task,
FAILED with the reason (fenced by its attempt), and nothing else: the rest of its
batch is published.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from ax_kombu.broker.celery_wire import CELERY_MESSAGES
from ax_kombu.broker.messages import RawJson, TaskMessage
from ax_kombu.broker.publisher import Publisher
from ax_kombu.config import Settings, worker_queue
from ax_kombu.core.states import Status
from ax_kombu.observability import metrics
from ax_kombu.store import Store
from ax_kombu.store.claims import Unbuildable, fail_unbuildable
from ax_kombu.store.transitions import transition

log = logging.getLogger(__name__)


def to_message(row: Any, node: str, now_ms: int) -> TaskMessage:
    """The message for one claimed row (columns in TaskMessage order, then the target node
    and the runner: see claims.claim). A row whose stored runner is a Celery one becomes
    that runner's :class:`~ax_kombu.broker.celery_wire.CeleryBound` message."""
    kind = CELERY_MESSAGES.get(row[13], TaskMessage) if len(row) > 13 else TaskMessage
    message = kind(row[0], row[1], row[2], RawJson(row[3]), row[4], row[5], row[6],
                   row[7], row[8], row[9], row[10], row[11], now_ms, node)
    if row[12] is not None:  # a shard for one worker: to that worker's own queue
        message = message._replace(route=worker_queue(row[12]))
    return message


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
            log.warning("broker unreachable; holding due tasks", extra={"error": cause})
            self._down_cause = cause

    def _report_up(self) -> None:
        if self._down_cause is not None:
            log.info("broker reachable again; dispatching", extra={"was": self._down_cause})
            self._down_cause = None

    def run(self) -> None:
        while (rows := self.inbox.get()) is not None:
            self._publish(rows)  # now: each carries its trigger time and starts then
        with self._publisher_lock:
            self.publisher.close()

    def _now(self) -> int:
        return int(self.store.clock.local_ms())  # never waits on the database

    def _publish(self, rows: Sequence[Any]) -> None:
        started = time.monotonic()
        now = self._now()
        messages = [to_message(r, self.node, now) for r in rows]
        with self._publisher_lock:
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
        if self._on_published is not None:
            self._on_published(sent, done)
        self.published += len(sent)
        metrics.dispatch_total.labels("ok").inc(len(sent))
        metrics.dispatch_latency.observe(time.monotonic() - started)
        if failed:
            self.broker_ok.clear()
            metrics.dispatch_total.labels("failed").inc(len(failed))
            self._give_back(sorted(m.task_id for m in failed))

    def _fail_refused(self, refused: list[tuple[TaskMessage, str]], now_ms: int) -> None:
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

    def _give_back(self, ids: list[int]) -> None:
        try:
            with self.store.engine.begin() as conn:
                back = transition(conn, ids, [Status.DISPATCHING], Status.READY)
        except SQLAlchemyError:
            log.exception("could not return unpublished tasks; the ack timeout will",
                          extra={"count": len(ids)})
            return
        self._on_returned(back)
