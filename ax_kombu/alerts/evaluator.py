"""The scheduler's pass over the alerts: incidents opened and closed, one message each.

Every pass (``alert_interval_ms``) looks at each alert's window of time since its last
pass, up to the database clock less :data:`SETTLE_MS` (so that an end committed a moment
after the time it records is not missed), and counts the window's events
(:mod:`ax_kombu.store.alerts`). Then one compare-and-set on the alert's row
(:func:`ax_kombu.store.alerts.advance`) moves the window and the incident state (a pass
that finds no event and closes nothing writes nothing, up to :data:`IDLE_WRITE_MS`: its
window is looked at again, longer, by the next pass):

* events, no incident open: an incident opens; the winner sends **firing** (the type,
  the events counted, a sample task id);
* events, an incident open: it is counted and goes on; nothing is sent;
* no event for ``alert_quiet_ms`` since the incident's last one: it closes; the winner
  sends **resolved** (with the incident's total).

The compare-and-set that opens or closes an incident writes its message into the row's
outbox in the same statement (:mod:`ax_kombu.alerts.outbox`); the pass also takes over
the outboxes whose takeover time has passed (their deliverer died, stopped or gave up).

Guarantees: with any number of schedulers, each window of each alert is judged once (the
compare-and-set's rowcount decides), so one incident makes one firing and one resolved
message, each delivered at least once whatever scheduler dies or stops (the outbox), with
the same ``webhook-id`` on every try (:mod:`ax_kombu.alerts.delivery`). The pass holds no
lock and writes one small row per alert; a database error skips the pass (the window
stays, the next pass covers it).
"""

from __future__ import annotations

import hashlib
import logging
from datetime import UTC, datetime
from typing import Any

from ax_kombu.alerts.delivery import Delivery, Message
from ax_kombu.alerts.outbox import TAKEOVER_MS, Outbox, entry
from ax_kombu.store import Store
from ax_kombu.store import alerts as alert_store

log = logging.getLogger(__name__)

#: the window ends this long before the database clock: an end or a start is stamped
#: with a time before its commit, and a window must not close before it is visible
SETTLE_MS = 1000
#: a pass that finds nothing to report leaves the row alone (its next window starts
#: where this one did) until the window is this long: a quiet alert costs one write a minute
IDLE_WRITE_MS = 60_000


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec="milliseconds")


def message_id(task_type: str, opened_at: int, kind: str) -> str:
    """The ``webhook-id`` of an incident's ``kind`` message: the same for every scheduler
    and every retry of it."""
    digest = hashlib.sha256(f"{task_type}\0{opened_at}\0{kind}".encode()).hexdigest()
    return f"msg_ax_{digest[:32]}"


def notification(alert: dict[str, Any], kind: str, opened_at: int, at: int, events: int,
                 failed: int, late: int, sample: int | None) -> Message:
    """The message of an incident's opening (``firing``) or end (``resolved``)."""
    on = [e for e, watched in (("failed", alert["on_failed"]), ("late", alert["on_late"]))
          if watched]
    data: dict[str, Any] = {
        "task_type": alert["task_type"], "status": kind, "on": on,
        "late_after_ms": alert["late_after_ms"], "opened_at": _iso(opened_at),
        "events": events, "sample_task_id": None if sample is None else str(sample)}
    if kind == "firing":
        data.update(failed=failed, late=late)
    else:
        data["resolved_at"] = _iso(at)
    body = {"type": f"ax.alert.{kind}", "timestamp": _iso(at), "data": data}
    return Message(alert["webhook"], alert["secret"],
                   message_id(alert["task_type"], opened_at, kind), body, alert["task_type"])


class Evaluator:
    """Judges every alert's latest window (:meth:`run_once`) and hands what opens or
    closes an incident to ``delivery``.

    Args:
        quiet_ms: an incident closes after this long without an event.
        takeover_ms: how long a deliverer alone has an alert's outbox
            (:mod:`ax_kombu.alerts.outbox`).
    """

    def __init__(self, store: Store, delivery: Delivery, quiet_ms: int,
                 takeover_ms: int = TAKEOVER_MS) -> None:
        self.store = store
        self.delivery = delivery
        self.quiet_ms = quiet_ms
        self.outbox = Outbox(store, delivery, takeover_ms)

    def run_once(self) -> int:
        """One pass over every alert; returns how many messages it queued."""
        now = self.store.now_ms()
        with self.store.engine.connect() as conn:
            rows = alert_store.list_all(conn)
        return sum(self._judge(alert, now - SETTLE_MS) or self.outbox.take_over(alert, now)
                   for alert in rows)

    def _judge(self, alert: dict[str, Any], until: int) -> int:
        since = alert["checked_until"]
        if until <= since:
            return 0
        with self.store.engine.begin() as conn:
            found = alert_store.events(conn, alert, since, until)
            changes, message = self._decide(alert, found, until)
            if message is None and not found.total and until - since < IDLE_WRITE_MS:
                return 0
            entries: list[dict[str, Any]] = []
            takeover = 0
            if message is not None:  # the message goes into the outbox with the move
                entries = [*alert_store.outbox_of(alert["outbox"]), entry(message, until)]
                takeover = until + SETTLE_MS + self.outbox.takeover_ms
                changes.update(outbox=alert_store.outbox_text(entries),
                               outbox_claimed_until=takeover)
            won = alert_store.advance(conn, alert["task_type"], since, changes,
                                      read_outbox=alert["outbox"])
        if won and message is not None:
            log.info("alert", extra={"task_type": alert["task_type"],
                                     "status": message.body["data"]["status"]})
            self.outbox.mark(alert["task_type"], takeover)
            return self.outbox.send_all(alert, entries)
        return 0

    def _decide(self, alert: dict[str, Any], found: alert_store.Events, until: int
                ) -> tuple[dict[str, Any], Message | None]:
        """The row's changes for this window, and the message they mean (None: none)."""
        opened_at = alert["opened_at"]
        if found.total:
            if opened_at is None:
                changes = {"checked_until": until, "opened_at": until, "last_event_at": until,
                           "events": found.total, "sample_task_id": found.sample_task_id}
                return changes, notification(alert, "firing", until, until, found.total,
                                             found.failed, found.late, found.sample_task_id)
            return {"checked_until": until, "last_event_at": until,
                    "events": alert["events"] + found.total}, None
        if opened_at is not None and until - alert["last_event_at"] >= self.quiet_ms:
            message = notification(alert, "resolved", opened_at, until, alert["events"], 0, 0,
                                   alert["sample_task_id"])
            return {"checked_until": until, "opened_at": None, "last_event_at": None,
                    "events": 0, "sample_task_id": None}, message
        return {"checked_until": until}, None
