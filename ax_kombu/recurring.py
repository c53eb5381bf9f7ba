"""Recurring jobs, the producer side: declare, change, pause, resume and remove them.

A job is a row in ``ax_job``: a schedule (``cron`` or ``every``, in ``tz``), a misfire
policy and the template of the task each occurrence becomes. Schedulers write its
occurrences as ordinary tasks ahead of time (:mod:`ax_kombu.scheduler.recurrence`).

Contract:

* :func:`schedule_job` is an idempotent upsert by name: called again with the same
  arguments (every deploy, every process) it writes nothing; with other arguments it
  updates the job and re-plans it: occurrences not yet dispatched and not yet due are
  removed and written again from the new definition; a new ``cron``/``every``/``tz``
  restarts the schedule from now. A paused job stays paused. A job a scheduler marked
  broken (its row could not be planned, :mod:`ax_kombu.scheduler.recurrence`) is written
  again from the arguments and planned anew by any call, the same arguments included
  (the zone may have been installed since).
* :func:`pause_job` removes the undispatched occurrences; nothing more is created until
  :func:`resume_job`, after which the occurrences missed meanwhile go by the job's misfire
  policy. :func:`unschedule_job` removes the job and its undispatched occurrences.
  Occurrences already dispatched or running are never touched.
* Bad input raises :class:`~ax_kombu.exceptions.ValidationError` and writes nothing.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, TypeVar

from sqlalchemy import Engine

from ax_kombu.config import Settings
from ax_kombu.core import cron
from ax_kombu.core.values import MAX_TASK_TYPE, STRATEGIES, show
from ax_kombu.exceptions import JobNotFound, ValidationError
from ax_kombu.store import jobs as job_store
from ax_kombu.store.engine import db_now_ms
from ax_kombu.store.tasks import wake_schedulers
from ax_kombu.validation import build_row

F = TypeVar("F", bound=Callable[..., Any])

#: what decides when a job fires: changing one of these restarts its schedule from now
_TIMING = ("cron", "every_ms", "tz")
_SPEC = ("task_type", "payload", "cron", "every_ms", "tz", "misfire", "misfire_grace_ms",
         "strategy", "priority", "max_retry", "timeout_ms", "processor_name", "callback_url")


@dataclass(frozen=True)
class JobView:
    """A read-only snapshot of one recurring job."""

    name: str
    task_type: str
    payload: Any
    cron: str | None
    every: timedelta | None
    tz: str
    misfire: str
    misfire_grace_s: float | None
    strategy: str
    priority: str
    max_retry: int
    timeout_ms: int
    processor_name: str | None
    callback_url: str | None
    paused: bool
    #: when the job fires next (aware, in ``tz``); None while paused, broken, or when it
    #: never will
    next_fire_at: datetime | None
    created_at: int
    updated_at: int
    #: why no scheduler plans the job (its stored row cannot be parsed); None: it is planned
    broken: str | None = None

    @property
    def schedule(self) -> str:
        """``cron '0 8 * * *' Asia/Shanghai`` or ``every 30s``."""
        if self.cron is not None:
            return f"cron {self.cron!r} {self.tz}"
        assert self.every is not None
        return f"every {cron.format_every(round(self.every.total_seconds() * 1000))}"


def job_schedule(row: Mapping[str, Any]) -> cron.Schedule:
    """The schedule of a stored job."""
    return cron.make_schedule(row["cron"], row["every_ms"], row["tz"], row["anchor_ms"])


def view(row: Mapping[str, Any], now_ms: int) -> JobView:
    """The job ``row`` as a :class:`JobView`, its next fire time seen from ``now_ms``
    (None for a broken job, or one this process cannot plan)."""
    upcoming = None
    broken = row.get("broken")
    if not row["paused"] and broken is None:
        try:
            at = job_schedule(row).next_after(now_ms)
        except ValidationError as exc:  # e.g. a zone this machine's tzdata lacks
            broken = f"cannot be planned here: {exc}"
            at = None
        upcoming = cron.to_datetime(at, row["tz"]) if at is not None else None
    grace = row["misfire_grace_ms"]
    return JobView(
        name=row["name"], task_type=row["task_type"], payload=json.loads(row["payload"]),
        cron=row["cron"],
        every=timedelta(milliseconds=row["every_ms"]) if row["every_ms"] is not None else None,
        tz=row["tz"], misfire=row["misfire"],
        misfire_grace_s=grace / 1000.0 if grace is not None else None,
        strategy=row["strategy"], priority=row["priority"], max_retry=row["max_retry"], timeout_ms=row["timeout_ms"],
        processor_name=row["processor_name"], callback_url=row["callback_url"],
        paused=bool(row["paused"]), next_fire_at=upcoming, created_at=row["created_at"],
        updated_at=row["updated_at"], broken=broken)


# -- validation ----------------------------------------------------------------------------------


def build_job(settings: Settings, now_ms: int, name: Any, task_type: Any, payload: Any = None, *,
              cron_expr: str | None = None, every: Any = None, tz: Any = "UTC",
              misfire: Any = "fire_once", misfire_grace_s: Any = None,
              strategy: Any = "parallel", priority: str = "default",
              max_retry: int | None = None,
              timeout_ms: int | None = None, processor: str | None = None,
              callback_url: str | None = None) -> dict[str, Any]:
    """Validate a job; returns its user-set columns (``spec`` included).

    Raises:
        ValidationError: any argument is invalid.
    """
    if not isinstance(name, str) or not name.strip() or len(name) > MAX_TASK_TYPE:
        raise ValidationError(f"job name must be a non-empty string of at most "
                              f"{MAX_TASK_TYPE} characters, got {show(name)}")
    if (cron_expr is None) == (every is None):
        raise ValidationError(f"job {name!r}: give exactly one of cron=… or every=…")
    every_ms = cron.every_ms(every) if every is not None else None
    tz_name = "UTC" if tz is None else tz
    cron.make_schedule(cron_expr, every_ms, tz_name, now_ms)  # validates expression and zone
    if misfire not in cron.MISFIRE_POLICIES:
        raise ValidationError(f"unknown misfire policy {show(misfire)}; use one of "
                              f"{', '.join(cron.MISFIRE_POLICIES)}")
    if strategy not in STRATEGIES:
        raise ValidationError(f"unknown strategy {show(strategy)}; use one of "
                              f"{', '.join(STRATEGIES)}")
    row = build_row(settings, now_ms, task_type, payload, priority=priority,
                    max_retry=max_retry, timeout_ms=timeout_ms, processor=processor,
                    callback_url=callback_url)
    values = {
        "task_type": row["task_type"], "payload": row["payload"],
        "cron": " ".join(cron_expr.split()) if cron_expr is not None else None,
        "every_ms": every_ms, "tz": tz_name, "misfire": misfire,
        "misfire_grace_ms": _grace_ms(misfire_grace_s), "strategy": strategy,
        "priority": row["priority"],
        "max_retry": row["max_retry"], "timeout_ms": row["timeout_ms"],
        "processor_name": row["processor_name"], "callback_url": row["callback_url"],
    }
    values["spec"] = hashlib.blake2b(json.dumps([values[k] for k in _SPEC]).encode(),
                                     digest_size=16).hexdigest()
    return {"name": name, **values}


def _grace_ms(grace_s: Any) -> int | None:
    if grace_s is None:
        return None
    if isinstance(grace_s, timedelta):
        grace_s = grace_s.total_seconds()
    if isinstance(grace_s, bool) or not isinstance(grace_s, (int, float)) \
            or not 0 <= grace_s <= cron.MAX_EVERY_MS / 1000:
        raise ValidationError(f"misfire_grace_s must be a number of seconds >= 0 (or None: "
                              f"no limit), got {show(grace_s)}")
    return round(grace_s * 1000)


# -- writes --------------------------------------------------------------------------------------


def schedule_job(engine: Engine, values: Mapping[str, Any], now_ms: int) -> str:
    """Create or update the job ``values["name"]`` (from :func:`build_job`).

    Returns:
        ``"created"``, ``"updated"`` or ``"unchanged"``.
    """
    name = values["name"]
    with engine.begin() as conn:
        current = job_store.get_job(conn, name, lock=True)
        if current is None:
            first = cron.make_schedule(values["cron"], values["every_ms"], values["tz"],
                                       now_ms).next_after(now_ms)
            row = {**values, "paused": False, "anchor_ms": now_ms, "next_fire_at": first,
                   "created_at": now_ms, "updated_at": now_ms}
            if job_store.insert_job(conn, row):
                return "created"
            current = job_store.get_job(conn, name, lock=True)  # a racing call created it
            assert current is not None
        if current.spec == values["spec"] and current.broken is None:
            return "unchanged"
        dropped = job_store.drop_undispatched(conn, name, from_ms=now_ms)
        changes = {**values, "updated_at": now_ms, "broken": None}
        if any(getattr(current, k) != values[k] for k in _TIMING):
            changes["anchor_ms"] = now_ms
            changes["next_fire_at"] = cron.make_schedule(
                values["cron"], values["every_ms"], values["tz"], now_ms).next_after(now_ms)
        else:
            changes["next_fire_at"] = _earliest(current.next_fire_at, dropped)
        job_store.update_job(conn, name, changes)
    return "updated"


def run_job_now(engine: Engine, name: str, task_id: int) -> None:
    """Write one occurrence of ``name`` due now, as the scheduler's materialiser writes
    each (:func:`ax_kombu.store.jobs.occurrence_row`: the same row, so the job's strategy
    gates it, and the same unique ``(job, scheduled_at)``), and wake the schedulers. A
    paused job runs too: pausing stops its schedule, not an operator.

    Raises:
        JobNotFound: no such job.
    """
    with engine.begin() as conn:
        job = job_store.get_job(conn, name)
        if job is None:
            raise JobNotFound(f"no recurring job {name!r}")
        now = db_now_ms(conn)
        job_store.insert_occurrences(conn, [job_store.occurrence_row(job, task_id, now, now,
                                                                     now)])
        wake_schedulers(conn, now)


def pause_job(engine: Engine, name: str, now_ms: int) -> None:
    """Pause ``name``: its undispatched occurrences are removed, none is created.

    Raises:
        JobNotFound: no such job.
    """
    with engine.begin() as conn:
        current = _locked(conn, name)
        if current.paused:
            return
        dropped = job_store.drop_undispatched(conn, name)
        job_store.update_job(conn, name, {"paused": True, "updated_at": now_ms,
                                          "next_fire_at": _earliest(current.next_fire_at,
                                                                    dropped)})


def resume_job(engine: Engine, name: str, now_ms: int) -> None:
    """Resume ``name``; what it missed while paused goes by its misfire policy.

    Raises:
        JobNotFound: no such job.
    """
    with engine.begin() as conn:
        if _locked(conn, name).paused:
            job_store.update_job(conn, name, {"paused": False, "updated_at": now_ms})


def unschedule_job(engine: Engine, name: str) -> int:
    """Remove ``name`` and its undispatched occurrences; returns how many were removed.

    Raises:
        JobNotFound: no such job.
    """
    with engine.begin() as conn:
        _locked(conn, name)
        dropped = job_store.drop_undispatched(conn, name)
        job_store.delete_job(conn, name)
    return len(dropped)


def _locked(conn: Any, name: str) -> Any:
    current = job_store.get_job(conn, name, lock=True)
    if current is None:
        raise JobNotFound(f"no recurring job {name!r}")
    return current


def _earliest(next_fire_at: int | None, dropped: list[int]) -> int | None:
    """The first occurrence to write again: the earliest of those removed, if any."""
    times = [t for t in [next_fire_at, *dropped] if t is not None]
    return min(times) if times else None


# -- @ax.periodic --------------------------------------------------------------------------------

_declared: dict[str, dict[str, Any]] = {}


def periodic(*, cron: str | None = None, every: Any = None, name: str | None = None,
             task_type: str | None = None, payload: Any = None, tz: str = "UTC",
             misfire: str = "fire_once", **options: Any) -> Callable[[F], F]:
    """Register the decorated function as a processor and declare a recurring job for it.

    The job (named ``name``, default the function's ``module.qualname``; its task type
    ``task_type``, default the name) is written to the store when ``ax-worker -A module``
    or ``ax-scheduler -A module`` starts (:func:`declared`), as :func:`ax.schedule` would.
    ``options`` are :func:`ax.schedule`'s (priority, max_retry, timeout_ms, misfire_grace_s).

    Raises:
        ValidationError: at import, for a bad schedule or option.
    """
    from ax_kombu.worker.processors import processor

    unknown = set(options) - {"priority", "max_retry", "timeout_ms", "misfire_grace_s",
                              "strategy"}
    if unknown:
        raise ValidationError(f"periodic() got unknown option(s) {', '.join(sorted(unknown))}")

    def declare(func: F) -> F:
        job = name or f"{func.__module__}.{func.__qualname__}"
        kind = task_type or job
        spec = {"task_type": kind, "payload": payload, "cron": cron, "every": every,
                "tz": tz, "misfire": misfire, **options}
        build_job(Settings(), 0, job, kind, payload, cron_expr=cron, every=every, tz=tz,
                  misfire=misfire, **options)  # fail at import, not at the worker's start
        processor(kind)(func)
        _declared[job] = spec
        return func

    return declare


def declared() -> dict[str, dict[str, Any]]:
    """The jobs ``@periodic`` declared in the modules imported so far: name → arguments."""
    return dict(_declared)
