"""Moving and cancelling tasks that have not run, by id or by business key: the producer's
side of :mod:`ax_kombu.store.moves` (which says what each guarantees), mixed into
:class:`ax_kombu.api.Client`."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import datetime
from typing import TYPE_CHECKING, Any

from ax_kombu.config import Settings
from ax_kombu.core import states
from ax_kombu.core.fingerprint import canonical_json, fingerprint
from ax_kombu.core.states import Status
from ax_kombu.core.values import MAX_BIZ_KEY, MAX_TASK_TYPE, check_text, show, trigger_ms
from ax_kombu.exceptions import IllegalTransition, ValidationError
from ax_kombu.store import Store, moves

if TYPE_CHECKING:
    from ax_kombu.views import TaskView

#: ``reschedule(payload=…)`` not given: the payload stays (None is a JSON payload)
UNCHANGED: Any = object()


def cancel_selection(now_ms: int, task_type: Any, status: Any, biz_keys: Any,
                     since: Any) -> moves.Selection:
    """The tasks ``cancel_many`` means.

    Raises:
        ValidationError: no filter given, a final or unknown status, a bad filter.
    """
    if task_type is None and biz_keys is None:
        raise ValidationError("cancel_many needs task_type or biz_keys (it never cancels "
                              "every task)")
    if task_type is not None:
        task_type = check_text("task_type", task_type, MAX_TASK_TYPE)
    statuses = tuple(sorted(str(s) for s in states.ACTIVE))
    if status is not None:
        try:
            wanted = Status(str(status).upper())
        except ValueError:
            raise ValidationError(f"unknown status {show(status)}") from None
        if wanted in states.FINAL:
            raise ValidationError(f"a {wanted} task cannot be cancelled; give a status of "
                                  "an unfinished task")
        statuses = (str(wanted),)
    keys = None
    if biz_keys is not None:
        if isinstance(biz_keys, str):
            raise ValidationError("biz_keys takes a list of keys, not one string")
        keys = tuple(check_text("biz_key", k, MAX_BIZ_KEY) for k in biz_keys)
    created_from = None if since is None else now_ms - trigger_ms(0, None, since)
    return moves.Selection(task_type, statuses, keys, created_from)


class Moving:
    """Client methods that move or cancel tasks (they read back through ``get``)."""

    settings: Settings
    store: Store

    get: Callable[[int], TaskView]  # the Client's

    def cancel(self, task_id: int | None = None, *, task_type: str | None = None,
               biz_key: str | None = None) -> TaskView:
        """Cancel a task that has not finished, by id or by ``(task_type, biz_key)``.

        Raises:
            ValidationError: neither or both ways of naming the task given.
            TaskNotFound: no such task.
            IllegalTransition: the task is already SUCCESS, FAILED or CANCELLED.
        """
        target = moves.Target(task_id, task_type, biz_key)
        with self.store.engine.begin() as conn:
            moved = moves.cancel(conn, target, self.store.now_ms())
            found = moved if moved is not None else moves.find(conn, target).task_id
        view = self.get(found)
        if moved is None:
            raise IllegalTransition(f"task {found} is {view.status}; only a task that has "
                                    "not finished can be cancelled")
        return view

    def cancel_many(self, *, task_type: str | None = None, status: Any = None,
                    biz_keys: Iterable[str] | None = None, since: Any = None,
                    batch: int = 5_000) -> int:
        """Cancel every unfinished task that matches all the filters given; returns how
        many. See :func:`ax_kombu.cancel_many`.

        Raises:
            ValidationError: no filter, a final status, or a bad filter; nothing changed.
        """
        now = self.store.now_ms()
        selection = cancel_selection(now, task_type, status, biz_keys, since)
        total = 0
        while True:  # short transactions: a cancel of 100,000 never locks them all at once
            with self.store.engine.begin() as conn:
                done = moves.cancel_some(conn, selection, now, batch)
            total += done
            if done < batch:
                return total

    def reschedule(self, task_id: int | None = None, *, task_type: str | None = None,
                   biz_key: str | None = None, run_at: datetime | None = None,
                   delay: Any = None, payload: Any = UNCHANGED, kind: str = "reschedule"
                   ) -> TaskView:
        """Move a task that has not started to a new time (and payload); see
        :func:`ax_kombu.reschedule`.

        Raises:
            ValidationError: bad arguments; nothing changed.
            TaskNotFound: no such task.
            TooLateToMove: it is claimed, staged for its start, or running.
            IllegalTransition: it has finished.
        """
        target = moves.Target(task_id, task_type, biz_key)
        now = self.store.now_ms()
        if run_at is None and delay is None and kind != "run_now":
            raise ValidationError("reschedule needs run_at or delay (run_now() moves a task "
                                  "to now)")
        to_time = trigger_ms(now, run_at, delay)
        text = None if payload is UNCHANGED else canonical_json(
            payload, self.settings.max_payload_bytes)
        with self.store.engine.begin() as conn:
            change = moves.Change(to_time, kind)
            if text is not None:  # the fingerprint is of the task's own type
                task_type = moves.find(conn, target).task_type
                change = moves.Change(to_time, kind, text, fingerprint(task_type, text))
            moved, _ = moves.move(conn, target, change, now,
                                  now + self.settings.preload_window_ms)
        return self.get(moved)

    def run_now(self, task_id: int | None = None, *, task_type: str | None = None,
                biz_key: str | None = None) -> TaskView:
        """:meth:`reschedule` to now (DB clock)."""
        return self.reschedule(task_id, task_type=task_type, biz_key=biz_key, kind="run_now")

