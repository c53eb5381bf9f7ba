"""Cluster-wide controls an operator sets through the client: limits on how many tasks of a
type run at once (:mod:`ax_kombu.store.gates`), paused task types and queues
(:mod:`ax_kombu.store.pauses`), and per-type alerts (:mod:`ax_kombu.alerts`); mixed into
:class:`ax_kombu.api.Client`.

Bad input raises :class:`~ax_kombu.exceptions.ValidationError` and writes nothing. A pause
or its lifting is recorded in the audit (``ax_audit``) with who made it and through what.
"""

from __future__ import annotations

import getpass
import os
from collections.abc import Iterable
from typing import Any

from ax_kombu.alerts import rules as alert_rules
from ax_kombu.config import PRIORITIES, Settings
from ax_kombu.core.values import MAX_TASK_TYPE, check_text, show
from ax_kombu.exceptions import ValidationError
from ax_kombu.store import Store, gates
from ax_kombu.store import alerts as alert_store
from ax_kombu.store import pauses as pause_store
from ax_kombu.store.audit import record as audit_record


def _os_user() -> str:
    """Who a pause made through the API is recorded as: the OS user."""
    try:
        return getpass.getuser()
    except (OSError, KeyError):
        return f"uid:{os.getuid()}"


class Controls:
    """Client methods that set and read the cluster-wide controls."""

    settings: Settings
    store: Store

    # -- cluster-wide limits (ax_kombu.store.gates) ---------------------------------------------

    def set_limit(self, task_type: str, max_running: int | None) -> None:
        """Set or clear (None) the limit of ``task_type``; see :func:`ax_kombu.set_limit`.

        Raises:
            ValidationError: bad task type or limit; nothing was written.
        """
        task_type = check_text("task_type", task_type, MAX_TASK_TYPE)
        if max_running is not None and (isinstance(max_running, bool)
                                        or not isinstance(max_running, int)
                                        or not 1 <= max_running <= 1_000_000):
            raise ValidationError(f"max_running must be an int within 1..1000000 or None, "
                                  f"got {show(max_running)}")
        with self.store.engine.begin() as conn:
            gates.set_limit(conn, task_type, max_running, self.store.now_ms())

    def limits(self) -> dict[str, int]:
        """Every limit: task type → most DISPATCHING or RUNNING at once."""
        with self.store.engine.connect() as conn:
            return gates.list_limits(conn)

    # -- paused types and queues (ax_kombu.store.pauses) ----------------------------------------

    def pause_type(self, task_type: str, *, actor: str | None = None,
                   via: str = "api") -> bool:
        """Pause ``task_type`` cluster-wide; see :func:`ax_kombu.pause_type`. ``actor``
        (default: the OS user) and ``via`` go to the pause and its audit record.

        Returns:
            False when it was paused already (nothing changed).
        Raises:
            ValidationError: not a task type name; nothing was written.
        """
        return self._set_pause("type", task_type, True, actor, via)

    def resume_type(self, task_type: str, *, actor: str | None = None,
                    via: str = "api") -> bool:
        """Lift the pause of ``task_type``; False when it was not paused."""
        return self._set_pause("type", task_type, False, actor, via)

    def pause_queue(self, queue: str, *, actor: str | None = None, via: str = "api") -> bool:
        """Pause the queue named ``queue`` (as configured: ``AX_QUEUE_SLOW``…) cluster-wide.

        Raises:
            ValidationError: not one of the configured queue names; nothing was written.
        """
        return self._set_pause("queue", queue, True, actor, via)

    def resume_queue(self, queue: str, *, actor: str | None = None, via: str = "api") -> bool:
        """Lift the pause of the queue named ``queue``; False when it was not paused."""
        return self._set_pause("queue", queue, False, actor, via)

    def pauses(self) -> list[pause_store.Pause]:
        """Every paused type and queue, with when and by whom."""
        with self.store.engine.connect() as conn:
            return pause_store.list_pauses(conn)

    def _set_pause(self, kind: str, name: str, on: bool, actor: str | None,
                   via: str) -> bool:
        """Store or delete one pause, then write its audit record."""
        queues = [self.settings.queue_for(p) for p in PRIORITIES]
        name = pause_store.check(kind, name, queues)
        who = check_text("actor", actor, 128) if actor is not None else _os_user()
        now = self.store.now_ms()
        with self.store.engine.begin() as conn:
            changed = (pause_store.pause(conn, kind, name, who, now) if on
                       else pause_store.resume(conn, kind, name, now))
        audit_record(self.store.engine, actor=who, via=via,
                     action=f"{'pause' if on else 'resume'}_{kind}", target=f"{kind}:{name}",
                     detail={"changed": changed})
        return changed

    # -- per-type alerts (ax_kombu.alerts) ------------------------------------------------------

    def set_alert(self, task_type: str, *, on: Iterable[str] | str | None = None,
                  late_after: Any = None, webhook: str, secret: str | None = None) -> str:
        """Set the alert of ``task_type``; returns its signing secret. See
        :func:`ax_kombu.set_alert`.

        Raises:
            ValidationError: a bad argument; nothing was written.
        """
        alert = alert_rules.check_alert(task_type, on, late_after, webhook, secret)
        with self.store.engine.begin() as conn:
            if secret is None:  # a changed alert keeps its secret: receivers keep verifying
                alert = alert._replace(secret=alert_store.secret_of(conn, alert.task_type)
                                       or alert.secret)
            alert_store.upsert(conn, alert.row(), self.store.now_ms())
        return alert.secret

    def remove_alert(self, task_type: str) -> bool:
        """Remove the alert of ``task_type`` (an open incident ends unannounced); False if
        there was none."""
        task_type = check_text("task_type", task_type, MAX_TASK_TYPE)
        with self.store.engine.begin() as conn:
            return alert_store.remove(conn, task_type)

    def alerts(self) -> list[dict[str, Any]]:
        """Every alert, by task type (without its secret): ``task_type``, ``on``,
        ``late_after_ms``, ``webhook``, and its open incident, if any: ``opened_at`` (epoch
        ms; None: none open) and ``events``."""
        with self.store.engine.connect() as conn:
            rows = alert_store.list_all(conn)
        return [{"task_type": r["task_type"],
                 "on": [e for e in alert_rules.EVENTS if r[f"on_{e}"]],
                 "late_after_ms": r["late_after_ms"], "webhook": r["webhook"],
                 "opened_at": r["opened_at"], "events": r["events"]} for r in rows]
