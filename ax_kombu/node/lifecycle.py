"""One node lifecycle for every ax daemon: register → beat → confirm the lease →
re-register when refused.

The scheduler (:mod:`ax_kombu.scheduler.heart`), the worker and the Celery bootstep
(:mod:`ax_kombu.celery.node`) each keep one :class:`NodeLifecycle`. Contracts:

* **Registration is a beat.** :meth:`NodeLifecycle.register` makes this process the
  live incarnation of its name (:meth:`ax_kombu.store.nodes.Heartbeat.register`, which
  takes over what an earlier incarnation left) and confirms the node's
  :class:`~ax_kombu.core.lease.Lease` for the new incarnation from the moment the
  registration was sent.
* **A beat that lands confirms the lease** for the incarnation it beat, from the moment
  it was sent (a beat is a compare-and-set on the live incarnation, and no peer declares
  a node dead before its last beat is a silence window old).
* **A beat refused** (the incarnation was declared dead, or replaced) revokes the lease
  at once, so nothing more is done under that incarnation, tells the daemon
  (``on_refused``: drop what it keeps in memory, withdraw what it staged), and
  registers anew, keeping the runs the daemon still runs (``keep_running``).
* **One error policy.** A beat or re-registration that fails (the database unreachable,
  a statement timeout) is logged, counted (``ax_housekeeping_errors_total{step="beat"}``)
  and reported (``on_failed``); the lease is not confirmed, and the next beat comes one
  interval later. Only :class:`~ax_kombu.exceptions.NodeNameInUse` (registering anew
  found the name taken by another live process) is raised: it ends the beating thread,
  and a supervised daemon with it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

from sqlalchemy import Connection

from ax_kombu.core.lease import Lease
from ax_kombu.exceptions import NodeNameInUse
from ax_kombu.observability import metrics
from ax_kombu.store.nodes import Heartbeat, TakeOver

log = logging.getLogger(__name__)


def _nothing() -> None:
    """The default hook: nothing to do."""


def _took(_: TakeOver) -> None:
    """The default ``on_registered``: nothing to do."""


def _first_line(exc: BaseException) -> str:
    """The first line of a failure's text (the driver's, if wrapped), for a probe's reason."""
    text = str(getattr(exc, "orig", None) or exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


class NodeLifecycle:
    """A node's registration, its beats and its lease (see the module docstring).

    Args:
        heartbeat: the node's row (name, kind, silence window, engine).
        lease: confirmed by every registration and every beat that lands.
        info: what each beat and registration publishes about the node.
        keep_running: the task ids this process runs now, left RUNNING by a
            re-registration (a worker's or a Celery worker's runs).
        on_refused: a beat was refused: stop acting under the old incarnation (called
            after the lease is revoked, before registering anew).
        on_registered: a registration (the first, or one after a refused beat) landed.
        on_failed: a beat or re-registration failed (the node may be cut off).
    """

    def __init__(self, heartbeat: Heartbeat, lease: Lease,
                 info: Callable[[], Mapping[str, Any]], *,
                 keep_running: Callable[[], Collection[int]] = tuple,
                 on_refused: Callable[[], None] = _nothing,
                 on_registered: Callable[[TakeOver], None] = _took,
                 on_failed: Callable[[], None] = _nothing) -> None:
        self.heartbeat = heartbeat
        self.lease = lease
        self._info = info
        self._keep_running = keep_running
        self._on_refused = on_refused
        self._on_registered = on_registered
        self._on_failed = on_failed
        #: beats that landed (tests and the node's info read it)
        self.beats = 0
        #: monotonic time the last landed beat (or registration) was sent; None before
        self.landed_at: float | None = None
        #: why the last beat failed (the database unreachable…); None once one lands
        self.failure: str | None = None
        #: monotonic time the last beat (or registration) was tried, landed or not; and
        #: whether one is being tried now (waiting on the database): the liveness probe
        self.tried_at: float | None = None
        self.trying = False

    @property
    def node_id(self) -> str:
        return self.heartbeat.node_id

    @property
    def incarnation(self) -> int:
        """This process's live incarnation (0 until registered)."""
        return self.heartbeat.incarnation

    def register(self) -> TakeOver:
        """Become the live incarnation of the name and confirm the lease for it.

        Returns:
            What was taken over from the earlier incarnation.
        Raises:
            NodeNameInUse: another live process has the name; nothing changed.
            SQLAlchemyError: the database failed (the caller decides: a daemon starting
                retries; a beat counts it as failed).
        """
        self.lease.revoke()
        sent = self.tried_at = time.monotonic()
        took = self.heartbeat.register(self._info(), keep_running=sorted(self._keep_running()))
        self.lease.confirm(sent, self.heartbeat.incarnation)
        self.landed_at, self.failure = sent, None
        self._on_registered(took)
        return took

    def beat(self) -> bool:
        """One beat, re-registering if refused; True if the node is live now (the beat
        landed, or the re-registration did), False if it failed (logged and counted).

        Raises:
            NodeNameInUse: registering anew found the name taken by a live process.
        """
        sent = self.tried_at = time.monotonic()
        self.trying = True
        try:
            if self.heartbeat.beat(self._info()):
                self.lease.confirm(sent, self.heartbeat.incarnation)
                self.landed_at, self.failure = sent, None
            else:
                self._refused()
        except NodeNameInUse:
            raise
        except Exception as exc:  # the one policy: nothing but a name clash ends the beats
            self.failure = _first_line(exc)
            self._on_failed()
            metrics.housekeeping_errors_total.labels("beat").inc()
            log.warning("heartbeat failed; beating again in one interval", exc_info=True,
                        extra={"node": self.node_id,
                               "error": str(getattr(exc, "orig", None) or exc)[:500]})
            return False
        finally:
            self.trying = False
        self.beats += 1
        return True

    def _refused(self) -> None:
        self.lease.revoke()
        log.warning("this node was declared dead; registering anew",
                    extra={"node": self.node_id, "incarnation": self.heartbeat.incarnation})
        metrics.fenced_total.inc()
        self._on_refused()
        took = self.register()
        log.info("registered as a new incarnation",
                 extra={"node": self.node_id, "incarnation": self.heartbeat.incarnation,
                        "requeued": took.requeued, "running": took.running})

    def beat_every(self, interval_s: float, stopped: threading.Event,
                   after: Callable[[], None] = _nothing) -> None:
        """Beat every ``interval_s`` until ``stopped`` is set (the first beat one interval
        after the call: the registration was one), calling ``after`` after each beat."""
        while not stopped.wait(interval_s):
            self.beat()
            after()

    def stop(self, conn: Connection | None = None) -> None:
        """Mark this incarnation stopped (a clean exit); in ``conn``'s transaction if given."""
        self.lease.revoke()
        self.heartbeat.stop(conn)
