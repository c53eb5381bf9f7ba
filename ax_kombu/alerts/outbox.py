"""An alert's messages outlive the scheduler that won them: the outbox of ``ax_alert``.

The compare-and-set that opens or closes an incident (:mod:`ax_kombu.alerts.evaluator`)
appends its message to the row's ``outbox`` in the same statement, and sets the outbox's
**takeover time** ``outbox_claimed_until`` to :data:`TAKEOVER_MS` ahead: until then the
winner alone delivers it. Then:

* the winner delivers it (:mod:`ax_kombu.alerts.delivery`) and, on a 2xx answer, takes it
  out of the outbox (a compare-and-set on the outbox: :func:`ax_kombu.store.alerts.take_out`);
* each failed try pushes the takeover time back past the wait before the next try, plus
  :data:`TAKEOVER_MS`; when the tries are spent it is set :data:`GIVEN_UP_MS` ahead and the
  message stays in the outbox;
* any scheduler's pass takes over an outbox whose takeover time has passed (its deliverer
  died, stopped or gave up) with a compare-and-set on that time, and delivers its messages
  anew, with the same ``webhook-id``; messages older than :data:`MAX_AGE_MS` are dropped
  then, with a warning.

So a message is delivered at least once whatever scheduler dies, and can arrive more than
once (a deliverer that dies after the receiver's 2xx and before the take-out; a receiver
slower than :data:`TAKEOVER_MS`): receivers dedupe on ``webhook-id``.

A scheduler pushes back or lets go only the takeover time it wrote (:class:`Outbox` keeps
them), so after a takeover by another scheduler the old deliverer's next push fails and it
leaves the message to the new one.
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

#: how long the deliverer alone has an outbox (pushed back while it retries)
TAKEOVER_MS = 60_000
#: when a deliverer has spent its tries: another pass (any scheduler's) tries again after
#: this long
GIVEN_UP_MS = 600_000
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
    """The takeover times this scheduler wrote on alert outboxes, and the :class:`Hooks
    <ax_kombu.alerts.delivery.Hooks>` its delivery thread calls.

    Args:
        takeover_ms: how long a deliverer alone has an outbox, pushed back past each
            retry's wait.
    """

    def __init__(self, store: Store, delivery: Delivery, takeover_ms: int = TAKEOVER_MS,
                 given_up_ms: int = GIVEN_UP_MS) -> None:
        self.store = store
        self.delivery = delivery
        self.takeover_ms = takeover_ms
        self.given_up_ms = given_up_ms
        self._lock = threading.Lock()
        #: task type -> the takeover time this scheduler wrote on its outbox
        self._mine: dict[str, int] = {}
        delivery.hooks = self

    def mark(self, task_type: str, until_ms: int) -> None:
        """This scheduler wrote the takeover time ``until_ms`` on the outbox of
        ``task_type``."""
        with self._lock:
            self._mine[task_type] = until_ms

    def send_all(self, alert: dict[str, Any], entries: list[dict[str, Any]]) -> int:
        """Queue ``entries`` (the outbox of ``alert``, just won) for delivery."""
        for item in entries:
            self.delivery.send(message_of(alert, item))
        return len(entries)

    def take_over(self, alert: dict[str, Any], now_ms: int) -> int:
        """Deliver the outbox of ``alert`` (a row as read) if it has messages and its
        takeover time has passed; returns how many were queued (0: none, or another
        scheduler took them over first)."""
        read = alert["outbox"]
        entries = alert_store.outbox_of(read)
        takeover = alert["outbox_claimed_until"]
        if not entries or (takeover is not None and takeover >= now_ms):
            return 0
        fresh = [e for e in entries if now_ms - int(e.get("at", now_ms)) < MAX_AGE_MS]
        until = now_ms + self.takeover_ms
        with self.store.engine.begin() as conn:
            won = alert_store.take_over_outbox(conn, alert["task_type"], takeover, read,
                                               alert_store.outbox_text(fresh), until)
        if not won:
            return 0
        if len(fresh) < len(entries):
            log.warning("alert messages undelivered for a day dropped",
                        extra={"task_type": alert["task_type"],
                               "dropped": len(entries) - len(fresh)})
        self.mark(alert["task_type"], until)
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
        except SQLAlchemyError as exc:  # left in the outbox: sent again after a takeover
            log.warning("delivered alert not taken out of its outbox",
                        extra={"message_id": message.message_id, "error": str(exc)})

    def retrying(self, message: Message, wait_s: float) -> bool:
        return self._push_back(message, round(wait_s * 1000) + self.takeover_ms)

    def gave_up(self, message: Message) -> None:
        if self._push_back(message, self.given_up_ms):
            log.warning("alert left in its outbox; tried again later",
                        extra={"message_id": message.message_id,
                               "retry_in_ms": self.given_up_ms})

    def let_go(self) -> None:
        """Let other schedulers take over at once the outboxes this one delivers (on a
        stop)."""
        with self._lock:
            mine, self._mine = self._mine, {}
        try:
            with self.store.engine.begin() as conn:
                for task_type, until in mine.items():
                    alert_store.push_back_outbox(conn, task_type, until, None)
        except SQLAlchemyError as exc:  # they are taken over at their takeover times
            log.warning("alert outboxes not let go", extra={"error": str(exc)})

    def _push_back(self, message: Message, ahead_ms: int) -> bool:
        """Move the takeover time of the outbox of ``message`` to ``ahead_ms`` from now;
        False if another scheduler has taken it over (or this one let it go)."""
        task_type = message.task_type
        if not task_type:
            return True
        with self._lock:
            mine = self._mine.get(task_type)
        if mine is None:
            return False
        try:
            until = self.store.now_ms() + ahead_ms
            with self.store.engine.begin() as conn:
                won = alert_store.push_back_outbox(conn, task_type, mine, until)
        except SQLAlchemyError as exc:  # keep trying: another may take it over meanwhile
            log.warning("alert outbox takeover time not pushed back",
                        extra={"message_id": message.message_id, "error": str(exc)})
            return True
        with self._lock:
            if self._mine.get(task_type) == mine:
                if won:
                    self._mine[task_type] = until
                else:
                    del self._mine[task_type]
            elif not won:  # this scheduler wrote a newer takeover time meanwhile
                return task_type in self._mine
        return won
