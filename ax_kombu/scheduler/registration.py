"""The scheduler's ``registration`` step: the node's row at start, its goodbye at the stop.

Start: wait for the database (a warning per try, backing off up to
``MAX_START_BACKOFF_S``), begin the timing wheel on database time, and register the node
through its heart's :class:`~ax_kombu.node.lifecycle.NodeLifecycle` (which confirms the
lease). A stop requested meanwhile ends the wait: :class:`StoppedEarly`, nothing registered.

Stop: mark the node stopped and wake the other schedulers in one transaction (their next
preload reads the share this node had), then give back the id reservation. If the
database does not answer, the others take the share once this node's heartbeat is silent.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from sqlalchemy.exc import SQLAlchemyError

from ax_kombu.core.ids import ReservedIds
from ax_kombu.node.lifecycle import NodeLifecycle
from ax_kombu.scheduler.timing import TimingLoop
from ax_kombu.store import Store, nodes
from ax_kombu.store.tasks import wake_schedulers

log = logging.getLogger(__name__)

#: longest wait between two tries to reach the database at start
MAX_START_BACKOFF_S = 10.0


class StoppedEarly(Exception):
    """A stop came before the database answered: the node never registered."""


class Registration:
    """The ``registration`` step (module docstring).

    Args:
        stopping: True once a stop was requested (ends the wait for the database).
    """

    name = "registration"

    def __init__(self, *, store: Store, timing: TimingLoop, lifecycle: NodeLifecycle,
                 heartbeat: nodes.Heartbeat, ids: ReservedIds, node_id: str,
                 stopping: Callable[[], bool]) -> None:
        self._store = store
        self._timing = timing
        self._lifecycle = lifecycle
        self._heartbeat = heartbeat
        self._ids = ids
        self._node_id = node_id
        self._stopping = stopping

    def start(self) -> None:
        """Begin the wheel and register, retrying until the database answers.

        Raises:
            StoppedEarly: a stop came first.
        """
        delay = 0.5
        while not self._stopping():
            try:
                self._timing.start_at(self._store.now_ms())
                self._lifecycle.register()
                return
            except SQLAlchemyError as exc:
                log.warning("database unreachable; retrying",
                            extra={"error": str(getattr(exc, "orig", exc)), "retry_in_s": delay})
                self._timing.idle(delay)
                delay = min(delay * 2, MAX_START_BACKOFF_S)
        raise StoppedEarly

    def stop(self) -> None:
        """Deregister, and wake the other schedulers: this node's share is theirs now."""
        try:
            with self._store.engine.begin() as conn:
                self._heartbeat.stop(conn)
                wake_schedulers(conn, int(self._store.clock.local_ms()))
            self._ids.release()
            log.info("scheduler stopped", extra={"node": self._node_id})
        except SQLAlchemyError:
            log.warning("could not deregister; the other schedulers take this node's share "
                        "once its heartbeat is silent", exc_info=True)
