"""The scheduler's alerting step: every ``alert_interval_ms`` on a thread of its own, the
per-type alerts' pass (:class:`ax_kombu.alerts.evaluator.Evaluator`), its messages sent by
a delivery thread of their own (:mod:`ax_kombu.alerts.delivery`).

Neither thread is a loop of the scheduler's pipeline: a slow database read or a dead
receiver delays only the next alert pass, never a claim or a publish. A pass that fails
on the database is logged and tried at the next interval. On a stop, messages not yet
delivered get a short grace, then this scheduler lets their outboxes go, so that another
scheduler's next pass delivers them (:mod:`ax_kombu.alerts.outbox`).
"""

from __future__ import annotations

from sqlalchemy.exc import SQLAlchemyError

from ax_kombu.alerts.delivery import Delivery
from ax_kombu.alerts.evaluator import Evaluator
from ax_kombu.config import Settings
from ax_kombu.exceptions import AxError
from ax_kombu.node.steps import Job, Timers
from ax_kombu.store import Store


def alerting_step(settings: Settings, store: Store) -> Timers:
    """The step that runs the alert passes and stops their delivery on the way out."""
    delivery = Delivery()
    evaluator = Evaluator(store, delivery, settings.alert_quiet_ms, settings.alert_takeover_ms)

    def final() -> None:
        delivery.stop()
        evaluator.outbox.let_go()

    return Timers("alerts", [Job("alerts", settings.alert_interval_ms / 1000,
                                 evaluator.run_once)],
                  tolerated=(SQLAlchemyError, AxError), final=final)
