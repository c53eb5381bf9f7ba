"""An alert's messages outlive the scheduler that won them: the outbox of ``ax_alert``.

The compare-and-set that opens or closes an incident (:mod:`ax_kombu.alerts.evaluator`)
appends its message to the row's ``outbox`` and sets ``outbox_claimed_until`` (the
winner's lease, :data:`LEASE_MS` by default) in the same statement. Then:

* the winner delivers it (:mod:`ax_kombu.alerts.delivery`) and, on a 2xx answer, takes it
  out of the outbox (a compare-and-set on the outbox: :func:`ax_kombu.store.alerts.take_out`);
* each failed try renews the lease to cover the wait before the next one and
  :data:`LEASE_MS` more; when the tries are spent the lease is set :data:`GIVE_UP_LEASE_MS`
  ahead and the message stays in the outbox;
* any scheduler's pass takes over an outbox whose lease ran out (its deliverer died, stopped
  or gave up) with a compare-and-set on the lease, and delivers its messages anew, with the
  same ``webhook-id``; messages older than :data:`MAX_AGE_MS` are dropped then, with a
  warning.

So a message is delivered at least once whatever scheduler dies, and can arrive more than
once (a deliverer that dies after the receiver's 2xx and before the take-out; a lease that
runs out under a slow receiver): receivers dedupe on ``webhook-id``.

A lease is known by its value: a scheduler renews or releases only the value it wrote
(:class:`Outbox` keeps them), so a takeover by another scheduler makes the old holder's
next renewal fail and it leaves the message to the new one.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from ax_kombu.alerts.delivery import Delivery, Message
from ax_kombu.store import Store
from ax_kombu.store import alerts as alert_store

log = logging.getLogger(__name__)

#: a deliverer's lease on an outbox (renewed while it retries)
LEASE_MS = 60_000
#: the lease set when a deliverer has spent its tries: another pass (any scheduler's) tries
#: again after this long
GIVE_UP_LEASE_MS = 600_000
#: a message not delivered this long after its incident event is dropped at a takeover
MAX_AGE_MS = 86_400_000


def entry(message: Message, at: int) -> dict[str, Any]:
    """The outbox entry of ``message``, made at ``at`` (epoch ms)."""
    return {"id": message.message_id, "kind": message.body["data"]["status"],
            "body": message.body, "at": at}


def message_of(alert: dict[str, Any], item: dict[str, Any]) -> Message:
    """The message of an outbox entry, sent to the alert's webhook as it is now."""
    return Message(alert["webhook"], alert["secret"], item["id"], item["body"],
                   alert["task_type"])


class Outbox:
    """This scheduler's leases on alert outboxes, and the :class:`Hooks
    <ax_kombu.alerts.delivery.Hooks>` its delivery thread calls.

    Args:
        lease_ms: the lease a deliverer takes, and renews past each retry's wait.
    """

    def __init__(self, store: Store, delivery: Delivery, lease_ms: int = LEASE_MS,
                 give_up_lease_ms: int = GIVE_UP_LEASE_MS) -> None:
        self.store = store
        self.delivery = delivery
        self.lease_ms = lease_ms
        self.give_up_lease_ms = give_up_lease_ms
        self._lock = threading.Lock()
        #: task type -> the lease value this scheduler wrote
        self._leases: dict[str, int] = {}
        delivery.hooks = self

    def hold(self, task_type: str, until_ms: int) -> None:
        """This scheduler wrote the lease ``until_ms`` on the outbox of ``task_type``."""
        with self._lock:
            self._leases[task_type] = until_ms

    def send_all(self, alert: dict[str, Any], entries: list[dict[str, Any]]) -> int:
        """Queue ``entries`` (the outbox of ``alert``, just leased) for delivery."""
        for item in entries:
            self.delivery.send(message_of(alert, item))
        return len(entries)

    def take_over(self, alert: dict[str, Any], now_ms: int) -> int:
        """Deliver the outbox of ``alert`` (a row as read) if it holds messages whose lease
        ran out; returns how many were queued (0: none, or another scheduler won them)."""
        read = alert["outbox"]
        entries = alert_store.outbox_of(read)
        claimed = alert["outbox_claimed_until"]
        if not entries or (claimed is not None and claimed >= now_ms):
            return 0
        fresh = [e for e in entries if now_ms - int(e.get("at", now_ms)) < MAX_AGE_MS]
        until = now_ms + self.lease_ms
        with self.store.engine.begin() as conn:
            won = alert_store.claim_outbox(conn, alert["task_type"], claimed, read,
                                           alert_store.outbox_text(fresh), until)
        if not won:
            return 0
        if len(fresh) < len(entries):
            log.warning("alert messages undelivered for a day dropped",
                        extra={"task_type": alert["task_type"],
                               "dropped": len(entries) - len(fresh)})
        self.hold(alert["task_type"], until)
        log.info("alert outbox taken over", extra={"task_type": alert["task_type"],
                                                    "messages": len(fresh)})
        return self.send_all(alert, fresh)

    # -- hooks of the delivery thread -------------------------------------------------------

    def delivered(self, message: Message) -> None:
        if not message.task_type:
            return
        try:
            with self.store.engine.begin() as conn:
                alert_store.take_out(conn, message.task_type, message.message_id)
        except SQLAlchemyError as exc:  # left in the outbox: sent again after the lease
            log.warning("delivered alert not taken out of its outbox",
                        extra={"message_id": message.message_id, "error": str(exc)})

    def retrying(self, message: Message, wait_s: float) -> bool:
        return self._renew(message, round(wait_s * 1000) + self.lease_ms)

    def gave_up(self, message: Message) -> None:
        if self._renew(message, self.give_up_lease_ms):
            log.warning("alert left in its outbox; tried again later",
                        extra={"message_id": message.message_id,
                               "retry_in_ms": self.give_up_lease_ms})

    def release(self) -> None:
        """Let other schedulers take over at once what this one holds (on a stop)."""
        with self._lock:
            leases, self._leases = self._leases, {}
        try:
            with self.store.engine.begin() as conn:
                for task_type, held in leases.items():
                    alert_store.renew_outbox(conn, task_type, held, None)
        except SQLAlchemyError as exc:  # they are taken over when the leases run out
            log.warning("alert outbox leases not released", extra={"error": str(exc)})

    def _renew(self, message: Message, ahead_ms: int) -> bool:
        """Move this scheduler's lease on the outbox of ``message`` to ``ahead_ms`` from
        now; False if another scheduler holds it (or it holds nothing now)."""
        task_type = message.task_type
        if not task_type:
            return True
        with self._lock:
            held = self._leases.get(task_type)
        if held is None:
            return False
        try:
            until = self.store.now_ms() + ahead_ms
            with self.store.engine.begin() as conn:
                won = alert_store.renew_outbox(conn, task_type, held, until)
        except SQLAlchemyError as exc:  # keep trying: the lease may run out meanwhile
            log.warning("alert outbox lease not renewed",
                        extra={"message_id": message.message_id, "error": str(exc)})
            return True
        with self._lock:
            if self._leases.get(task_type) == held:
                if won:
                    self._leases[task_type] = until
                else:
                    del self._leases[task_type]
            elif not won:  # this scheduler wrote a newer lease meanwhile: it still holds
                return task_type in self._leases
        return won
