"""Replacing celery beat: :func:`import_beat_schedule` turns ``beat_schedule`` into ax jobs.

Each entry becomes the ax recurring job of the same name (:func:`ax_kombu.schedule`,
an idempotent upsert: importing again at every start is safe), whose occurrences are
Celery-bound tasks (:mod:`ax_kombu.celery.producer`). Any number of ax-schedulers then
create exactly one task per occurrence and send it to Celery, where a single beat
process did.

Schedules: ``crontab`` becomes its 5-field cron expression in the app's time zone
(``app.timezone``); ``timedelta``, a number of seconds and ``schedule(run_every=…)``
become ``every=``. ``solar`` is not supported, nor a crontab restricting both the day of
the month and the day of the week (Celery requires both to match, cron either one): both
raise :class:`~ax_kombu.exceptions.ValidationError` before anything is written.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any

from celery.schedules import crontab, schedule

import ax_kombu
from ax_kombu.api import Client
from ax_kombu.broker.celery_wire import processor_for
from ax_kombu.celery.producer import call_payload, queue_of, uses_bootstep
from ax_kombu.exceptions import ValidationError
from ax_kombu.recurring import JobView

_ROUTING = ("queue", "routing_key", "exchange", "exchange_type")


def import_beat_schedule(app: Any, *, client: Client | None = None, prefix: str = "",
                         misfire: str = "fire_once") -> list[JobView]:
    """Create or update one ax recurring job per entry of ``app.conf.beat_schedule``.

    Args:
        app: the Celery app.
        client: the ax client to write with (default: :func:`ax_kombu.client`).
        prefix: put before each entry's name to make the job's name.
        misfire: the jobs' misfire policy (see :func:`ax_kombu.schedule`).
    Returns:
        The jobs, in the schedule's order.
    Raises:
        ValidationError: an entry ax cannot represent (the message names it); every
            entry is checked before any job is written.
    """
    specs = [job_spec(app, prefix + name, entry)
             for name, entry in (app.conf.beat_schedule or {}).items()]
    writer = client or ax_kombu.client()
    return [writer.schedule(name, task, payload, misfire=misfire, **options)
            for name, task, payload, options in specs]


def job_spec(app: Any, name: str,
             entry: Mapping[str, Any]) -> tuple[str, str, dict[str, Any], dict[str, Any]]:
    """``(job name, task name, payload, schedule options)`` of one beat entry."""
    try:
        task, when = entry["task"], entry["schedule"]
    except (KeyError, TypeError):
        raise ValidationError(f"beat entry {name!r} needs 'task' and 'schedule'") from None
    options = entry.get("options") or {}
    payload = call_payload(entry.get("args") or (), entry.get("kwargs"),
                           time_limit=options.get("time_limit"),
                           soft_time_limit=options.get("soft_time_limit"))
    routing = {k: options[k] for k in _ROUTING if options.get(k) is not None}
    queue = queue_of(app, task, payload["args"], payload["kwargs"], routing)
    return name, task, payload, {**trigger(app, name, when),
                                 "processor": processor_for(queue, uses_bootstep(app))}


def trigger(app: Any, name: str, when: Any) -> dict[str, Any]:
    """``cron=``/``tz=`` or ``every=`` for one beat entry's schedule."""
    if isinstance(when, crontab):
        return {"cron": cron_of(name, when), "tz": str(app.timezone)}
    if isinstance(when, schedule):
        return {"every": when.run_every}
    if isinstance(when, timedelta) or (isinstance(when, (int, float))
                                       and not isinstance(when, bool)):
        return {"every": when}
    raise ValidationError(f"beat entry {name!r}: a {type(when).__name__} schedule is not "
                          "supported (crontab, timedelta or seconds)")


def cron_of(name: str, c: Any) -> str:
    """The 5-field cron expression of a Celery ``crontab``, as it was written."""
    fields = [_field(getattr(c, f"_orig_{f}")) for f in
              ("minute", "hour", "day_of_month", "month_of_year", "day_of_week")]
    if fields[2] != "*" and fields[4] != "*":
        raise ValidationError(f"beat entry {name!r}: a crontab restricting both day_of_month "
                              "and day_of_week runs when both match; cron runs when either "
                              "does: split it into two entries")
    return " ".join(fields)


def _field(value: Any) -> str:
    if isinstance(value, str):
        return value.replace(" ", "")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, Iterable):
        return ",".join(str(v) for v in sorted(value))
    raise ValidationError(f"a crontab field ax cannot read: {value!r}")
